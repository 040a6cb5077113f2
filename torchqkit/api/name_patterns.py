"""Regular expressions over module names whose matching time is bounded before they run.

Note [Bounded name patterns]
"re:" keys of ModuleConfigs come from users and from checkpoint headers, so they can be hostile. Python's ``re``
backtracks and has no timeout: "(a+)+$" against "aaaaaaaaaaaaaaaaaaaaaaaaa!" takes about a second, and each
further "a" doubles that; a thread running it can't be stopped, a process per match is far too slow. So a pattern is checked on its parse tree (``re._parser``,
the tree ``re.compile`` itself builds) before it is used, and one is taken only if the work of every match has
a known bound:
  * at most MAX_PATTERN_CHARS characters; no backreferences ("\\1", "(?P=name)") and no conditional groups
    ("(?(1)a|b)"): those make matching exponential whatever the rest looks like;
  * the body of a group repeated more than once ("(...)*", "(...)+", "(...){2,5}") holds no choice: no other
    variable repeat and no "|". A repeated body that can match the same text in several ways ("(a+)+",
    "(a|ab)*") is where exponential backtracking comes from. Character classes ("[qkv]", "\\d", ".") are one
    choice-free step, so "(q|k|v)" (which re turns into a class) is fine;
  * what remains is a finite set of choice points: each variable repeat picks a count, each "|" a branch. A
    match tries at most every combination of them. The counts of k repeats that consume text add up to at
    most the name's length L, so there are at most C(L + k, k) combinations of counts (and at most the product
    of the repeats' ranges); times the number of branch choices and the pattern's size, that bounds the steps
    (``steps(L)``). A lookaround ("(?!lm_head)") is a sub-pattern bounded the same way, run at each of those
    steps. The pattern must stay under MAX_STEPS for names of TYPICAL_NAME_CHARS characters (about four ".*"
    and a few "|"), and every match checks the bound for the actual name's length first, so a pattern that
    is fine on short names raises on a very long one instead of hanging.
MAX_STEPS is far above what any documented pattern needs (r"layers\\.\\d+\\.mlp\\..*" on a 100-character name:
about 1e5); a match near it ("\\d*\\d*\\d*\\d*x" on 100 digits) took 0.04 s on a 2-core machine.
"""
from __future__ import annotations

import math
import re

try:  # re's own parse tree (the public API has none); Python 3.10 names it sre_parse
    from re import _constants as _sre
    from re import _parser as _sre_parser
except ImportError:
    import sre_constants as _sre
    import sre_parse as _sre_parser

__all__ = ["NamePattern", "MAX_PATTERN_CHARS", "MAX_STEPS", "TYPICAL_NAME_CHARS"]

MAX_PATTERN_CHARS = 512
MAX_STEPS = 10**8
TYPICAL_NAME_CHARS = 100

RULE = ("torchqkit bounds the time a pattern can take (Python's re has no timeout and can backtrack "
        "exponentially): at most {chars} characters, no backreferences or conditional groups, a repeated group "
        "('(...)*', '(...)+', '(...){{m,n}}') holds only fixed text and character classes (no other '*', '+', "
        "'?', '{{m,n}}' or '|' inside), and few enough repeats in a row (about four '.*' for names of "
        "{typical} characters). Rewrite it (e.g. '.*' instead of '(\\w+\\.)*', '[qkv]_proj' or "
        "'(q|k|v)_proj' instead of '(\\w)+_proj') or list the module names as exact keys"
        ).format(chars=MAX_PATTERN_CHARS, typical=TYPICAL_NAME_CHARS)

_CHOICE_REPEATS = tuple(getattr(_sre, name) for name in ("MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT")
                        if hasattr(_sre, name))  # possessive repeats and atomic groups are new in Python 3.11
_ATOMIC_GROUP = getattr(_sre, "ATOMIC_GROUP", None)
_ONE_STEP = (_sre.LITERAL, _sre.NOT_LITERAL, _sre.ANY, _sre.IN, _sre.AT)


class UnboundedPatternError(ValueError):
    """A pattern whose matching time can't be bounded (see Note [Bounded name patterns])."""


class _Scope:
    """The choice points of one sub-pattern matched as a whole: the main pattern, or a lookaround's body."""

    def __init__(self):
        self.repeats: list[tuple[int, int, int]] = []  # (min, max, narrowest width of one iteration)
        self.branches = 1  # product of the number of alternatives of every "|"

    def combinations(self, length: int) -> int:
        ranges = [max(1, min(hi, length // max(width, 1)) - lo + 1) for lo, hi, width in self.repeats]
        bound = math.prod(ranges)
        if all(width >= 1 for _, _, width in self.repeats):  # counts add up to at most the name's length
            bound = min(bound, math.comb(length + len(self.repeats), len(self.repeats)))
        return bound * self.branches


class _Analysis:
    def __init__(self):
        self.scopes: list[_Scope] = [_Scope()]
        self.size = 0  # parse-tree nodes: the work of one combination is at most proportional to it

    def walk(self, items, scope: _Scope, in_repeat: bool) -> None:
        for op, av in items:
            self.size += 1
            if op in _ONE_STEP:
                continue
            if op is _sre.SUBPATTERN:
                self.walk(av[3], scope, in_repeat)
            elif op is _ATOMIC_GROUP:
                self.walk(av, scope, in_repeat)
            elif op in _CHOICE_REPEATS:
                self._repeat(av, scope, in_repeat)
            elif op is _sre.BRANCH:
                if in_repeat:
                    raise UnboundedPatternError("an alternation '|' inside a repeated group can backtrack exponentially")
                scope.branches *= len(av[1])
                for branch in av[1]:
                    self.walk(branch, scope, in_repeat)
            elif op in (_sre.ASSERT, _sre.ASSERT_NOT):
                self.scopes.append(_Scope())
                self.walk(av[1], self.scopes[-1], in_repeat)
            elif op in (_sre.GROUPREF, _sre.GROUPREF_EXISTS):
                raise UnboundedPatternError("a backreference or conditional group makes matching exponential")
            else:  # a construct this check doesn't know: refuse rather than guess
                raise UnboundedPatternError(f"the construct {op} is not supported in module-name patterns")

    def _repeat(self, av, scope: _Scope, in_repeat: bool) -> None:
        lo, hi, body = av
        if lo != hi:
            if in_repeat:
                raise UnboundedPatternError("a repeat inside a repeated group (like '(a+)+' or '(\\w+\\.)*') can "
                                       "backtrack exponentially")
            scope.repeats.append((int(lo), int(hi), int(body.getwidth()[0])))  # plain ints: copyable
        # a body run more than once must hold no choice; "?" (at most once) only adds its own
        self.walk(body, scope, in_repeat or hi > 1)

    def steps(self, length: int) -> int:
        return self.size * math.prod(scope.combinations(length) for scope in self.scopes)


class NamePattern:
    """A compiled pattern that fullmatches module names, within MAX_STEPS. Raises UnboundedPatternError (a
    ValueError) for a pattern that doesn't compile or can't be bounded; ``what`` names it in the message."""

    def __init__(self, source: str, what: str):
        self.what = what
        if len(source) > MAX_PATTERN_CHARS:
            raise UnboundedPatternError(f"{what}: the pattern has {len(source)} characters, more than "
                                   f"{MAX_PATTERN_CHARS}. {RULE}")
        try:
            self.regex = re.compile(source)
            tree = _sre_parser.parse(source)
        except (re.error, RecursionError, OverflowError) as e:
            raise UnboundedPatternError(f"{what} is not a valid regular expression: {e}") from None
        self._analysis = _Analysis()
        try:
            self._analysis.walk(tree.data, self._analysis.scopes[0], in_repeat=False)
        except UnboundedPatternError as e:
            raise UnboundedPatternError(f"{what}: {e}. {RULE}") from None
        except RecursionError:
            raise UnboundedPatternError(f"{what}: its groups are nested too deeply. {RULE}") from None
        typical = self._analysis.steps(TYPICAL_NAME_CHARS)
        if typical > MAX_STEPS:
            raise UnboundedPatternError(f"{what}: on a {TYPICAL_NAME_CHARS}-character module name it could take about "
                                   f"{typical:.1e} steps, more than {MAX_STEPS:.0e}: too many repeats or "
                                   f"alternatives one after another. {RULE}")
        self._steps_by_length: dict[int, int] = {}

    def fullmatch(self, name: str) -> bool:
        self.check_bounded(name)
        return self.regex.fullmatch(name) is not None

    def check_bounded(self, name: str) -> None:
        """Raise UnboundedPatternError if matching ``name`` could take more than MAX_STEPS (it depends on its length)."""
        length = len(name)
        steps = self._steps_by_length.get(length)
        if steps is None:
            steps = self._steps_by_length[length] = self._analysis.steps(length)
        if steps > MAX_STEPS:
            raise UnboundedPatternError(f"{self.what} can't be matched against the module name {name[:80]!r}"
                                   f"{'...' if length > 80 else ''} ({length} characters) in bounded time: up to "
                                   f"{steps:.1e} steps, more than {MAX_STEPS:.0e}. Use fewer repeats in a row, or "
                                   f"an exact key for this module. {RULE}")
