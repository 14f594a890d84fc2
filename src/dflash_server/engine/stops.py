"""Stop strings over streamed text: find them across token boundaries and never release
text that might turn out to be the start of one."""
from __future__ import annotations


class StopStringMatcher:
    def __init__(self, stops: tuple[str, ...]):
        self.stops = tuple(s for s in stops if s)
        self.text = ""        # everything decoded so far
        self.released = 0     # text[:released] has been handed out
        self.matched: str | None = None

    def push(self, delta: str) -> tuple[str, bool]:
        """Add decoded text; return (text safe to release now, stopped)."""
        if self.matched is not None:
            return "", True
        self.text += delta
        if not self.stops:
            out, self.released = self.text[self.released:], len(self.text)
            return out, False
        longest = max(len(s) for s in self.stops)
        start = max(0, self.released - longest + 1)
        hits = [(i, s) for s in self.stops if (i := self.text.find(s, start)) != -1]
        if hits:
            idx, self.matched = min(hits)
            out = self.text[self.released:idx]
            self.released = idx
            self.text = self.text[:idx]
            return out, True
        # hold back the longest tail that is a prefix of some stop string
        hold = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(self.text)), hold, -1):
                if self.text.endswith(s[:n]):
                    hold = n
                    break
        safe = len(self.text) - hold
        out = self.text[self.released:safe] if safe > self.released else ""
        self.released = max(self.released, safe)
        return out, False

    def flush(self) -> str:
        """End of generation without a stop: release what was held back."""
        out = self.text[self.released:] if self.matched is None else ""
        self.released = len(self.text)
        return out
