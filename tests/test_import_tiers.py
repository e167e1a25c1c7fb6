"""The import tiers in pyproject.toml name every module of the project: a module left out of them is
under no rule, and `lint-imports` would pass an import of it that breaks the tiers."""

import os

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: pytest's own TOML reader
    import tomli as tomllib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _config() -> dict:
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)["tool"]["importlinter"]


def _children(package: str) -> list[str]:
    """The modules and subpackages directly inside a package folder."""
    folder = os.path.join(ROOT, *package.split("."))
    out = []
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        if name.endswith(".py") and name != "__init__.py":
            out.append(f"{package}.{name[:-3]}")
        elif os.path.isfile(os.path.join(path, "__init__.py")):
            out.append(f"{package}.{name}")
    return out


def test_every_module_sits_in_a_tier():
    config = _config()
    tiers = next(c for c in config["contracts"] if c["id"] == "tiers")
    listed = {m.strip() for layer in tiers["layers"] for m in layer.replace("|", ":").split(":")}
    missing = [m for root in config["root_packages"] for m in _children(root)
               if not any(m == t or m.startswith(t + ".") for t in listed)]
    assert not missing, f"modules in no import tier (add each to a layer of the 'tiers' contract): {missing}"


def test_the_cycle_contract_covers_every_root_package():
    config = _config()
    acyclic = next(c for c in config["contracts"] if c["type"] == "acyclic_siblings")
    assert set(acyclic["ancestors"]) == set(config["root_packages"])
