"""Whether a decode step drafts: speculation's measured goodput against plain decoding's, per
batch size (`--disable-adaptive-speculation` turns this off: every step drafts).

Drafting pays only while a verify forward plus the drafter cost less than the tokens it
commits would cost one at a time. That depends on the model, the device, the drafter's
acceptance on this traffic and the batch size (a large batch is compute-bound: K + 1 tokens a
request cost nearly K + 1 times one), which is too much to predict and cheap to measure:

    yield       tokens committed per request in a drafting step, averaged over request-steps:
                per bucket once it has WARMUP drafting steps, else over every bucket (a
                drafter's acceptance hardly depends on the batch size, but how often it finds
                drafts at all can: the n-gram drafter on a batch of chat answers may find none)
    step time   per batch-size bucket, drafting and not: averages of decode-only steps' wall
                time (steady, so a few steps tell). A step more than OUTLIER times the
                average counts as OUTLIER times it, and one below 1 / OUTLIER of it starts
                the average anew: the first verify step of each new shape captures a CUDA
                graph or compiles a kernel (~0.1-0.3 s), and one such step in the average
                made drafting lose until its weight decayed, which at 2 exploring steps per
                512 took the rest of a run
    warm-up     a bucket's first WARMUP steps draft, the next WARMUP do not; no bucket stops
                drafting before the yield has YIELD_WARMUP request-steps (at batch 1 the
                first few steps of an answer that will quote its prompt find no n-gram: a
                yield read off them turned drafting off for the whole run)
    choice      then it drafts while yield / time drafting > 1 / time not drafting
    exploring   every `interval` steps it runs EXPLORE steps the other way, so that a change
                is noticed; the interval starts at EXPLORE_MIN and doubles, up to EXPLORE_MAX,
                each time the other way is measured losing again (while drafting loses 4x,
                exploring costs ~2 * 4 / 512: under 2%)

Buckets grow by sqrt(2): batch sizes 1, 2, 3, 4, 5-6, 7-8, 9-11, 12-16, ...

DESIGN §9.1: a load-adaptive choice may only apply where it cannot change a request's tokens:
greedy requests, and unseeded sampling ones (not reproducible anyway; rejection sampling keeps
their distribution). Seeded sampling requests always draft their own K (engine/speculation.py);
a step where they drafted against the gate's choice is not measured.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

WARMUP = 3
EXPLORE = 2
EXPLORE_MIN = 16
EXPLORE_MAX = 512
ALPHA = 0.3  # weight of a new step in a bucket's time averages
YIELD_ALPHA = 0.02  # weight of one request-step in the yield average
YIELD_WARMUP = 32  # request-steps of yield before any bucket may stop drafting
OUTLIER = 3.0  # step times beyond this factor of their average are clipped, or restart it


class _Mean:
    """An exponential average of weighted samples: the plain mean of the first ones, until
    that gives a sample less weight than `alpha` would (so the first sample does not weigh
    ~(1 - alpha) ** n after n more, as with a first sample that sets the average)."""

    def __init__(self) -> None:
        self.value, self.samples, self.weight = 0.0, 0, 0.0

    def add(self, x: float, alpha: float, weight: float = 1.0) -> None:
        """`weight` samples of value x at once (a step of n requests: n request-steps)."""
        self.weight += weight
        rate = max(1.0 - (1.0 - alpha) ** weight, weight / self.weight)
        self.value += rate * (x - self.value)
        self.samples += 1

    def add_time(self, seconds: float, alpha: float) -> None:
        """A step's wall time, robust to one-off slow steps (OUTLIER)."""
        if self.samples and seconds < self.value / OUTLIER:
            self.value, self.samples, self.weight = seconds, 1, 1.0  # the average was off
            return
        self.add(min(seconds, OUTLIER * self.value) if self.samples else seconds, alpha)


@dataclass
class _Bucket:
    on: _Mean = field(default_factory=_Mean)  # step seconds, drafting
    off: _Mean = field(default_factory=_Mean)  # step seconds, not drafting
    yield_: _Mean = field(default_factory=_Mean)  # tokens per request of its drafting steps
    drafts: bool = True  # the current winner
    steps: int = 0  # steps chosen since the last exploration began
    interval: int = EXPLORE_MIN

    def warm(self) -> bool:
        return self.on.samples >= WARMUP and self.off.samples >= WARMUP


def bucket_of(batch_size: int) -> int:
    """The bucket index of a batch size: sizes within a factor sqrt(2) share one."""
    return round(2 * math.log2(max(1, batch_size)))


class DraftGate:
    def __init__(self) -> None:
        self.buckets: dict[int, _Bucket] = {}
        self.yield_ = _Mean()  # tokens committed per request in a drafting step

    def _bucket(self, batch_size: int) -> _Bucket:
        return self.buckets.setdefault(bucket_of(batch_size), _Bucket())

    def _wins(self, b: _Bucket) -> bool:
        """Drafting commits more tokens per second than not (per request: both steps hold
        the same requests)."""
        y = b.yield_ if b.yield_.samples >= WARMUP else self.yield_
        return y.value * b.off.value >= b.on.value

    def choose(self, batch_size: int) -> bool:
        """Whether a step of `batch_size` requests in decode drafts."""
        b = self._bucket(batch_size)
        if not b.warm():
            return b.on.samples < WARMUP
        if self.yield_.weight < YIELD_WARMUP:
            return True  # nothing decided yet (record): measure the yield
        b.steps += 1
        if b.steps > b.interval:  # an exploration window: the loser for EXPLORE steps
            if b.steps > b.interval + EXPLORE:
                b.steps = 1
            else:
                return not b.drafts
        return b.drafts

    def record(self, batch_size: int, drafted: bool, tokens: int, seconds: float) -> None:
        """A decode-only step of `batch_size` requests that drafted (or not) as chosen:
        `tokens` committed in all, in `seconds` of wall time."""
        if batch_size < 1 or seconds <= 0:
            return
        b = self._bucket(batch_size)
        if drafted:
            b.on.add_time(seconds, ALPHA)
            # one step of n requests weighs as n request-steps
            self.yield_.add(tokens / batch_size, YIELD_ALPHA, batch_size)
            b.yield_.add(tokens / batch_size, YIELD_ALPHA, batch_size)
        else:
            b.off.add_time(seconds, ALPHA)
        if not b.warm() or self.yield_.weight < YIELD_WARMUP:
            return  # b.drafts stays as it is (True until a first decision)
        wins = self._wins(b)
        if wins != b.drafts:  # the winner changed: look again soon
            b.drafts, b.interval, b.steps = wins, EXPLORE_MIN, 0
        elif drafted != b.drafts:  # an exploration confirmed the loser: look less often
            b.interval = min(2 * b.interval, EXPLORE_MAX)

    def stats(self) -> dict[int, dict]:
        """Per bucket (keyed by its middle batch size, round(sqrt(2) ** k)): step times,
        whether it drafts, and the yield; for logs and benchmarks."""
        out = {}
        for k, b in sorted(self.buckets.items()):
            out[round(2 ** (k / 2))] = {
                "drafts": b.drafts, "on_seconds": b.on.value, "off_seconds": b.off.value,
                "on_samples": b.on.samples, "off_samples": b.off.samples,
                "interval": b.interval, "yield": b.yield_.value,
                "yield_all": self.yield_.value,
            }
        return out
