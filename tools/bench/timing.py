"""Alternating secure and plaintext training steps in one process, and timing them.

Estimator rebuilds its graph, session and input pipeline on every `train()`
call, so timing `train()` calls measures graph construction, and timing the
two twins one after the other lets a change in machine load (another job,
thermal state) pass for a difference between them. Here each twin makes ONE
`train()` call, in its own thread, and a `Conductor` lets only one twin step
at a time, following a schedule of segments::

    warm-up secure, warm-up plain,
    round 0: secure N steps, plain N steps,
    round 1: plain N steps, secure N steps,      (the order alternates)
    ...,
    one untimed step each (the final checkpoint is saved outside any timed round)

A `StepTimer` hook waits for its twin's turn in `before_run` and records the
wall time from there to its `after_run` (the `session.run` of the step plus
the other hooks' `after_run`, which are the same Estimator hooks for both
twins). Graph construction, session creation, variable initialisation and
the first checkpoint happen before a twin's first `before_run`, so never
inside a timed round. The other twin is blocked on a condition variable
meanwhile and uses no CPU.
"""
import dataclasses
import statistics
import threading
import time
from typing import Callable, Dict, List, Optional, Sequence

import tensorflow as tf

__all__ = ["Segment", "Conductor", "StepTimer", "schedule", "run_alternating"]


@dataclasses.dataclass(frozen=True)
class Segment:
    twin: str
    steps: int
    round: Optional[int]  # None: untimed (warm-up, cool-down)


def schedule(twins: Sequence[str], warmup: int, rounds: int, steps: int) -> List[Segment]:
    """Warm-up, `rounds` alternating rounds of `steps` steps, one cool-down step each."""
    segments = [Segment(t, warmup, None) for t in twins if warmup > 0]
    for k in range(rounds):
        order = twins if k % 2 == 0 else list(reversed(twins))
        segments += [Segment(t, steps, k) for t in order]
    segments += [Segment(t, 1, None) for t in twins]
    return segments


class Conductor:
    """Lets one twin step at a time, in the order of `segments`; collects step times."""

    def __init__(self, segments: Sequence[Segment]) -> None:
        self.segments = list(segments)
        self._index = 0
        self._left = self.segments[0].steps
        self._cond = threading.Condition()
        self._failed = False
        self.times: Dict[str, Dict[int, List[float]]] = {}
        for s in self.segments:
            if s.round is not None:
                self.times.setdefault(s.twin, {}).setdefault(s.round, [])

    def steps_of(self, twin: str) -> int:
        """How many steps `twin` runs in all (its `train(steps=...)`)."""
        return sum(s.steps for s in self.segments if s.twin == twin)

    def acquire(self, twin: str) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self._failed or self._current_twin() == twin)
            if self._failed:
                raise RuntimeError("the other twin failed; stopping")

    def release(self, twin: str, seconds: float) -> None:
        with self._cond:
            segment = self.segments[self._index]
            assert segment.twin == twin, (segment, twin)
            if segment.round is not None:
                self.times[twin][segment.round].append(seconds)
            self._left -= 1
            if self._left == 0:
                self._index += 1
                if self._index < len(self.segments):
                    self._left = self.segments[self._index].steps
            self._cond.notify_all()

    def fail(self) -> None:
        with self._cond:
            self._failed = True
            self._cond.notify_all()

    def _current_twin(self):
        return self.segments[self._index].twin if self._index < len(self.segments) else None


class StepTimer(tf.estimator.SessionRunHook):
    """Runs `twin`'s steps only on its turn and times each; `on_begin(graph)` sees the graph."""

    def __init__(self, conductor: Conductor, twin: str, on_begin: Optional[Callable] = None) -> None:
        self._conductor = conductor
        self._twin = twin
        self._on_begin = on_begin
        self._start = None

    def begin(self):
        if self._on_begin is not None:
            self._on_begin(tf.compat.v1.get_default_graph())

    def before_run(self, run_context):
        self._conductor.acquire(self._twin)
        self._start = time.perf_counter()

    def after_run(self, run_context, run_values):
        self._conductor.release(self._twin, time.perf_counter() - self._start)


def run_alternating(train_fns: Dict[str, Callable[[List[tf.estimator.SessionRunHook], int], None]],
                    warmup: int, rounds: int, steps: int,
                    on_begin: Optional[Dict[str, Callable]] = None) -> Dict[str, Dict[int, List[float]]]:
    """Runs each twin's `train_fn(hooks, steps)` in its own thread, alternating rounds.

    The twins' graphs are built one after the other (the second starts once
    the first is ready to step), so graph construction never overlaps a
    timed round. Returns `times[twin][round]`, seconds per step.
    """
    twins = list(train_fns)
    conductor = Conductor(schedule(twins, warmup, rounds, steps))
    errors: Dict[str, BaseException] = {}
    ready = {t: threading.Event() for t in twins}

    def body(twin):
        hook = StepTimer(conductor, twin, (on_begin or {}).get(twin))
        original = hook.before_run

        def before_run(run_context):
            ready[twin].set()
            return original(run_context)

        hook.before_run = before_run
        try:
            train_fns[twin]([hook], conductor.steps_of(twin))
        except BaseException as e:  # pylint: disable=broad-except
            errors[twin] = e
            conductor.fail()
        finally:
            ready[twin].set()

    threads = []
    for twin in twins:
        thread = threading.Thread(target=body, args=(twin,), name=f"bench-{twin}", daemon=True)
        thread.start()
        threads.append(thread)
        ready[twin].wait()
    for thread in threads:
        thread.join()
    if errors:
        twin, error = next(iter(errors.items()))
        raise RuntimeError(f"the {twin} twin failed: {error}") from error
    return conductor.times


def summarize(times: Dict[str, Dict[int, List[float]]], secure: str = "secure", plain: str = "plaintext") -> Dict:
    """Median ms/step per twin, and the ratio as the median of per-round ratios.

    Adjacent rounds run under nearly the same machine load, so the ratio of
    each round's medians is a paired comparison; its median over rounds is
    the reported ratio.
    """
    def median_ms(values):
        return 1e3 * statistics.median(values)

    all_s = [t for r in times[secure].values() for t in r]
    all_p = [t for r in times[plain].values() for t in r]
    round_ratios = [median_ms(times[secure][k]) / median_ms(times[plain][k]) for k in sorted(times[secure])]
    return {
        "secure_ms_per_step": median_ms(all_s),
        "plaintext_ms_per_step": median_ms(all_p),
        "ratio": statistics.median(round_ratios),
        "round_ratios": round_ratios,
        "secure_round_ms": [median_ms(times[secure][k]) for k in sorted(times[secure])],
        "plaintext_round_ms": [median_ms(times[plain][k]) for k in sorted(times[plain])],
        "timed_steps": {"secure": len(all_s), "plaintext": len(all_p)},
    }
