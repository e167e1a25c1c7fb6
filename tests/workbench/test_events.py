"""The run's events (workbench/events.py): one dataclass per kind, and the dict form the TUI's views read."""

import dataclasses

from workbench import events
from workbench.events import CandidateTried, Challenged, EndToEndResumed, Event, PointDone, StageStarted
from workbench.search_results import CandidateResult, PointResult


def test_every_kind_has_one_event_class():
    kinds = [cls.kind for cls in vars(events).values()
             if isinstance(cls, type) and issubclass(cls, Event) and cls is not Event]
    assert len(kinds) == len(set(kinds)) >= 19
    assert all(dataclasses.is_dataclass(cls) for cls in vars(events).values()
               if isinstance(cls, type) and issubclass(cls, Event))


def test_the_dict_form_names_the_kind_and_leaves_unset_options_out():
    search = object()
    assert StageStarted("build", preset="beam-tiny").as_dict() == {"type": "stage", "stage": "build",
                                                                  "preset": "beam-tiny"}
    assert StageStarted("search", order=["boundary"], search=search).as_dict() == \
        {"type": "stage", "stage": "search", "order": ["boundary"], "search": search}
    assert EndToEndResumed().as_dict() == {"type": "resumed_end_to_end"}
    assert EndToEndResumed(2).as_dict() == {"type": "resumed_end_to_end", "builds": 2}
    failed = Challenged("experts", "triton", None, 10.0, 11.0, False, model_gate="logits")
    assert failed.as_dict() == {"type": "challenger", "point": "experts", "variant": "triton", "config": None,
                                "op_us": 10.0, "choice_op_us": 11.0, "won": False, "model_gate": "logits"}


def test_results_travel_in_their_json_form():
    c = CandidateResult("boundary", "triton", "triton", {"BLOCK": 64}, True, step_us=5.0)
    r = PointResult("boundary", "triton", {"BLOCK": 64}, 10.0, 5.0, 0.02, [c])
    assert CandidateTried("boundary", c).as_dict() == {"type": "candidate", "point": "boundary", "result": c.to_dict()}
    done = PointDone("boundary", r).as_dict()
    assert done["result"] == r.to_dict() and PointResult.from_dict(done["result"]) == r
