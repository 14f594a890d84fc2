"""When a prompt is compressed and how much of it is kept (plain Python: the server uses it).

``PFlashPolicy`` holds the server's settings (``--prefill-compression``, ``--prefill-threshold``,
``--prefill-keep-ratio``, ``--prefill-curve``); ``decide`` combines them with a request's
override, whether the prompt continues a conversation, and the session bandit's ratio.
``KeepRatioBandit`` moves a session's keep ratio by the DFlash acceptance its answers get:
a prompt cut too hard makes the target less predictable, and the draft's acceptance drops.
"""
from __future__ import annotations

import collections
from dataclasses import dataclass

MODES = ("off", "auto", "always")


def parse_curve(points) -> tuple[tuple[int, float], ...]:
    """``["10000:0.5", "40000:0.2"]`` (or pairs) -> sorted ((tokens, ratio), ...)."""
    out = []
    for p in points or ():
        if isinstance(p, str):
            t, sep, r = p.partition(":")
            if not sep:
                raise ValueError(f"a curve point is TOKENS:RATIO, got {p!r}")
            try:
                t, r = int(t), float(r)
            except ValueError:
                raise ValueError(f"a curve point is TOKENS:RATIO, got {p!r}") from None
        else:
            t, r = p
        if t < 1 or not 0.0 < r <= 1.0:
            raise ValueError(f"curve point {t}:{r}: tokens must be >= 1 and the ratio in (0, 1]")
        out.append((int(t), float(r)))
    out.sort()
    if len({t for t, _ in out}) != len(out):
        raise ValueError("curve points must have distinct token counts")
    return tuple(out)


def curve_ratio(curve, n: int) -> float:
    """Piecewise-linear in the prompt length, flat outside the points."""
    if n <= curve[0][0]:
        return curve[0][1]
    for (t0, r0), (t1, r1) in zip(curve, curve[1:]):
        if n <= t1:
            return r0 + (r1 - r0) * (n - t0) / (t1 - t0)
    return curve[-1][1]


def check_ratio(r, what: str = "keep ratio") -> float:
    if isinstance(r, bool) or not isinstance(r, (int, float)) or not 0.0 < float(r) <= 1.0:
        raise ValueError(f"{what} must be a number in (0, 1], got {r!r}")
    return float(r)


@dataclass(frozen=True)
class Override:
    """A request's ``prefill_compression``: a mode, or any of mode / keep_ratio / threshold."""
    mode: str | None = None
    keep_ratio: float | None = None
    threshold: int | None = None

    @classmethod
    def parse(cls, value) -> "Override | None":
        if value is None:
            return None
        if isinstance(value, str):
            value = {"mode": value}
        if not isinstance(value, dict):
            raise ValueError("prefill_compression must be off, auto, always or an object "
                             "{mode, keep_ratio, threshold}")
        unknown = set(value) - {"mode", "keep_ratio", "threshold"}
        if unknown:
            raise ValueError(f"prefill_compression: unknown field(s) {sorted(unknown)}")
        mode = value.get("mode")
        if mode is not None and mode not in MODES:
            raise ValueError(f"prefill_compression.mode must be one of {', '.join(MODES)}, got {mode!r}")
        ratio = value.get("keep_ratio")
        ratio = None if ratio is None else check_ratio(ratio, "prefill_compression.keep_ratio")
        th = value.get("threshold")
        if th is not None and (isinstance(th, bool) or not isinstance(th, int) or th < 1):
            raise ValueError(f"prefill_compression.threshold must be an integer >= 1, got {th!r}")
        return cls(mode, ratio, th)


@dataclass(frozen=True)
class PFlashPolicy:
    mode: str = "off"
    threshold: int = 4096
    keep_ratio: float = 0.1
    curve: tuple[tuple[int, float], ...] = ()

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"prefill compression must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.threshold < 1:
            raise ValueError(f"prefill threshold must be >= 1, got {self.threshold}")
        check_ratio(self.keep_ratio, "prefill keep ratio")

    def decide(self, n_tokens: int, override: Override | None = None, continuation: bool = False,
               session_ratio: float | None = None) -> float | None:
        """The keep ratio for a prompt of ``n_tokens``, or None: prefill it whole. A request
        that asks for ``always`` itself is compressed even as a continuation; otherwise a
        continuation (history with assistant or tool turns) is not, so it keeps hitting the
        prefix cache of the turns before it."""
        o = override or Override()
        mode = o.mode or self.mode
        if mode == "off":
            return None
        if continuation and o.mode != "always":
            return None
        if mode == "auto" and n_tokens < (o.threshold or self.threshold):
            return None
        if o.keep_ratio is not None:
            return o.keep_ratio
        if session_ratio is not None:
            return session_ratio
        if self.curve:
            return curve_ratio(self.curve, n_tokens)
        return self.keep_ratio

    def describe(self) -> dict:
        return {"mode": self.mode, "threshold": self.threshold, "keep_ratio": self.keep_ratio,
                "curve": [list(p) for p in self.curve]}


class KeepRatioBandit:
    """A keep ratio per ``session_id``, steered by the acceptance rate of its answers: an
    EMA (weight ``alpha`` on the newest) aimed at [low, high]; below it the session keeps
    more (+big step under low - 0.1, else +small), above it less (-small); always within
    [lo, hi]. At most ``max_sessions`` are remembered (least recently used go first)."""

    def __init__(self, start: float = 0.10, lo: float = 0.025, hi: float = 0.20, alpha: float = 0.7,
                 target: tuple[float, float] = (0.75, 0.85), small: float = 0.005, big: float = 0.01,
                 max_sessions: int = 1024):
        self.start, self.lo, self.hi, self.alpha = start, lo, hi, alpha
        self.target, self.small, self.big, self.max_sessions = target, small, big, max_sessions
        self._s: collections.OrderedDict[str, list[float | None]] = collections.OrderedDict()  # id -> [ratio, ema]

    def ratio(self, session: str) -> float:
        got = self._s.get(session)
        if got is None:
            return self.start
        self._s.move_to_end(session)
        return got[0]

    def observe(self, session: str, accept_rate: float) -> float:
        """Fold one answer's acceptance rate (accepted / drafted, in [0, 1]) in; returns the new ratio."""
        if not 0.0 <= accept_rate <= 1.0:
            raise ValueError(f"acceptance rate must be in [0, 1], got {accept_rate}")
        st = self._s.get(session)
        if st is None:
            st = self._s[session] = [self.start, None]
            while len(self._s) > self.max_sessions:
                self._s.popitem(last=False)
        self._s.move_to_end(session)
        ema = accept_rate if st[1] is None else self.alpha * accept_rate + (1 - self.alpha) * st[1]
        st[1] = ema
        low, high = self.target
        if ema < low:
            st[0] += self.big if ema < low - 0.1 else self.small
        elif ema > high:
            st[0] -= self.small
        st[0] = round(min(self.hi, max(self.lo, st[0])), 6)
        return st[0]

    def __len__(self) -> int:
        return len(self._s)
