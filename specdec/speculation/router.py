"""DraftRouter: which proposer drafts for a request, from a cheap guess of the prompt's domain and
from the gain each proposer measured on that domain.

The gain of a proposer on a request is decode tokens per unit of cost (the controller charges each
step this request's share of the measured step cost, or static costs in deterministic mode). Per
domain the router runs a bandit over proposers: each untried one is tried first (in the domain's
prior order), then UCB1 on the gain normalised by the domain's best mean, with discounted counts
(policy.DiscountedRate, tuned as ROUTER_GAIN) so it follows traffic that drifts. When a request's
acceptance collapses mid-way, `switch` names the best proposer the request has not tried yet.
Under exact verification none of this changes output, only speed.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from specdec.speculation import registry
from specdec.speculation.policy import ROUTER_GAIN, DiscountedRate

DOMAINS = ("code_edit", "code_gen", "chat", "prose", "zh")

_CJK = re.compile(r"[\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af]")
_CODE_LINE = re.compile(r"^\s*(def |class |import |from \S+ import|return\b|for .*:$|if .*:$|#include|"
                        r"fn |func |public |private |function\b|const |let |var |\}|\{$|@\w+)", re.MULTILINE)
_EDIT_WORDS = re.compile(r"\b(change|rename|refactor|fix|modify|edit|rewrite|update|apply|add (a |type )?"
                         r"(docstring|type hints?|comments?|logging)|replace|convert)\b", re.IGNORECASE)
_CODE_ASK = re.compile(r"\b(function|implement|python|javascript|typescript|rust|java|c\+\+|sql|regex|class|"
                       r"script|code|algorithm|method|api|program)\b", re.IGNORECASE)
_USER_TURN = re.compile(r"<\|im_start\|>user\n(.*?)(?:<\|im_end\|>|$)", re.DOTALL)


def guess_domain(text: str) -> str:
    """A cheap, deterministic guess of a prompt's domain (one of DOMAINS). For a chat-templated
    prompt only the last user turn counts (the system prompt is the same everywhere)."""
    turns = _USER_TURN.findall(text)
    if turns:
        text = turns[-1]
    if len(_CJK.findall(text)) >= max(2, len(text) // 10):
        return "zh"
    code_lines = len(_CODE_LINE.findall(text))
    has_code = "```" in text or code_lines >= 3
    if has_code and _EDIT_WORDS.search(text):
        return "code_edit"
    if has_code or _CODE_ASK.search(text):
        return "code_gen"
    if text.rstrip().endswith("?") or re.match(r"\s*(how|what|why|can|could|should|is|are|do|does|which|who|explain|give|recommend|tell|"
                                                r"suggest|help|compare)\b",
                                               text, re.IGNORECASE):
        return "chat"
    return "prose"


@dataclass
class ArmStats:
    # discounted sum of gains (tokens per unit cost) over discounted observations; every arm of a
    # domain ages by one observation whenever any of them is observed
    gain: DiscountedRate = field(default_factory=lambda: DiscountedRate(ROUTER_GAIN))
    choices: int = 0         # requests routed here
    observations: int = 0

    @property
    def weight(self) -> float:
        """Discounted number of observations (0: never observed)."""
        return self.gain.trials

    @property
    def mean(self) -> float:
        """Discounted mean gain (0 before any observation)."""
        return self.gain.estimate(0.0)


class DraftRouter:
    def __init__(self, exploration: float = 0.2) -> None:
        self.exploration = exploration
        self.arms: dict[tuple[str, str], ArmStats] = {}   # (domain, proposer id) -> stats
        self.num_switches = 0

    def _arm(self, domain: str, proposer: str) -> ArmStats:
        return self.arms.setdefault((domain, proposer), ArmStats())

    def choose(self, domain: str, candidates: list[str]) -> str:
        """The proposer for a new request of this domain, among `candidates` (non-empty)."""
        assert candidates, "no proposer to route to"
        ordered = self._prior_order(domain, candidates)
        untried = [c for c in ordered if self._arm(domain, c).weight == 0]
        choice = untried[0] if untried else max(ordered, key=lambda c: self._score(domain, c, ordered))
        self._arm(domain, choice).choices += 1
        return choice

    def switch(self, domain: str, current: str, tried: set[str], candidates: list[str]) -> str | None:
        """Another proposer for a request whose acceptance collapsed under `current`: the best-scoring
        one it has not tried yet, or None (it decodes plainly and re-probes later)."""
        rest = [c for c in self._prior_order(domain, candidates) if c != current and c not in tried]
        if not rest:
            return None
        self.num_switches += 1
        untried = [c for c in rest if self._arm(domain, c).weight == 0]
        return untried[0] if untried else max(rest, key=lambda c: self._arm(domain, c).mean)

    def observe(self, domain: str, proposer: str, tokens: int, cost: float) -> None:
        """A request (or the part of it this proposer served) produced `tokens` decode tokens at `cost`."""
        if tokens <= 0 or cost <= 0:
            return
        for (d, _), arm in self.arms.items():  # every arm of the domain ages by one observation
            if d == domain:
                arm.gain.age()
        arm = self._arm(domain, proposer)
        arm.gain.add(tokens / cost)
        arm.observations += 1

    def forget(self, proposer: str) -> None:
        """The proposer was unloaded: what was learned about it may not hold for its next load."""
        for key in [k for k in self.arms if k[1] == proposer]:
            del self.arms[key]

    def snapshot(self) -> dict[str, dict[str, dict[str, float]]]:
        """domain -> proposer -> {gain, weight, choices, observations} (for /admin and metrics)."""
        out: dict[str, dict[str, dict[str, float]]] = {}
        for (domain, proposer), a in sorted(self.arms.items()):
            out.setdefault(domain, {})[proposer] = {"gain": a.mean, "weight": a.weight, "choices": a.choices,
                                                    "observations": a.observations}
        return out

    def _score(self, domain: str, proposer: str, candidates: list[str]) -> float:
        best = max(self._arm(domain, c).mean for c in candidates) or 1.0
        total = sum(self._arm(domain, c).weight for c in candidates)
        arm = self._arm(domain, proposer)
        return arm.mean / best + self.exploration * math.sqrt(math.log(max(total, 1.0)) / arm.weight)

    @staticmethod
    def _prior_order(domain: str, candidates: list[str]) -> list[str]:
        """The order to try proposers in before anything is measured: a kind that prefers the domain
        first (prompt lookup where the output copies the prompt), then draft models in config
        order, then the other model-free kinds. A candidate that is not a kind is a draft model."""
        free = registry.model_free_kinds()
        preferred = [c for c in candidates if c in free and domain in registry.get(c).preferred_domains]
        models = [c for c in candidates if c not in free]
        return preferred + models + [c for c in candidates if c in free and c not in preferred]
