"""The loss curve: training loss per step, a moving average over it, and the held-out evaluations as
points, on one shared axis; as an SVG image (no plotting library needed) and as a PNG where matplotlib is
installed."""

from __future__ import annotations

from html import escape

W, H, PAD = 720, 420, 56


def moving_average(values: list[float]) -> list[float]:
    """Each value averaged with the ones before it over a window of a fiftieth of the run."""
    window = max(1, len(values) // 50)
    return [sum(values[max(0, i - window + 1):i + 1]) / len(values[max(0, i - window + 1):i + 1])
            for i in range(len(values))]


def loss_curve_svg(train: list, evals: list, title: str) -> str:
    """`train`: [step, loss, lr] rows; `evals`: dicts with "step" and "loss" (nats per token)."""
    steps = [r[0] for r in train] or [0]
    losses = [r[1] for r in train] + [e["loss"] for e in evals]
    lo, hi = (min(losses), max(losses)) if losses else (0.0, 1.0)
    hi = hi if hi > lo else lo + 1.0
    x_max = max(steps[-1], 1)

    def x(step):
        return PAD + (W - 2 * PAD) * step / x_max

    def y(loss):
        return H - PAD - (H - 2 * PAD) * (loss - lo) / (hi - lo)

    def polyline(points, colour, width):
        pts = " ".join(f"{x(s):.1f},{y(v):.1f}" for s, v in points)
        return f'<polyline fill="none" stroke="{colour}" stroke-width="{width}" points="{pts}"/>'

    smooth = list(zip(steps, moving_average([r[1] for r in train])))
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" '
             'font-size="12">', f'<rect width="{W}" height="{H}" fill="white"/>',
             f'<text x="{W / 2}" y="22" text-anchor="middle" font-size="14">{escape(title)}</text>',
             f'<line x1="{PAD}" y1="{H - PAD}" x2="{W - PAD}" y2="{H - PAD}" stroke="black"/>',
             f'<line x1="{PAD}" y1="{PAD}" x2="{PAD}" y2="{H - PAD}" stroke="black"/>']
    for i in range(5):
        v, s = lo + (hi - lo) * i / 4, round(x_max * i / 4)
        parts += [f'<text x="{PAD - 6}" y="{y(v) + 4:.1f}" text-anchor="end">{v:.2f}</text>',
                  f'<text x="{x(s):.1f}" y="{H - PAD + 16}" text-anchor="middle">{s}</text>']
    parts += [f'<text x="{W / 2}" y="{H - 12}" text-anchor="middle">step</text>',
              f'<text x="16" y="{H / 2}" transform="rotate(-90 16 {H / 2})" text-anchor="middle">'
              'cross-entropy (nats per token)</text>',
              polyline([(r[0], r[1]) for r in train], "#c6d4e8", 1), polyline(smooth, "#1f5fa8", 2)]
    parts += [f'<circle cx="{x(e["step"]):.1f}" cy="{y(e["loss"]):.1f}" r="4" fill="#d0602a"/>' for e in evals]
    parts += [f'<text x="{W - PAD}" y="{PAD - 8}" text-anchor="end" fill="#1f5fa8">training (moving average)</text>',
              f'<text x="{W - PAD}" y="{PAD + 8}" text-anchor="end" fill="#d0602a">held out</text>', "</svg>"]
    return "\n".join(parts) + "\n"


def loss_curve_png(train: list, evals: list, title: str, path: str) -> bool:
    """The loss curve as a PNG with matplotlib, where it is installed; False where it is not."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.2, 4.2), dpi=100)
    steps, losses = [r[0] for r in train], [r[1] for r in train]
    smooth = moving_average(losses)
    ax.plot(steps, losses, color="#c6d4e8", linewidth=0.8)
    ax.plot(steps, smooth, color="#1f5fa8", linewidth=1.8, label="training (moving average)")
    ax.plot([e["step"] for e in evals], [e["loss"] for e in evals], "o", color="#d0602a", label="held out")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats per token)")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True
