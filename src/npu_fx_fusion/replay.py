"""An exact match found again at another node, without running torch's matcher.

Every decoder layer repeats its sites: the same ops, with the same literals, wired the same
way. Once torch's matcher has matched an exact pattern at one site, `MatchShape` records
that site as it is in the graph: each matched node's op, target, literal arguments and user
count, and which argument is which matched node or bound argument. `MatchShape.find(node)`
walks the graph from `node` along that record. Where every node agrees, the region is
isomorphic to the recorded one, so torch's matcher, whose verdict depends only on those
things, matches it too, binding the corresponding nodes; the walk returns that match.

It is stricter than the matcher (a node with another number of users, a literal of another
type, a node wired to two places the record has apart): where it finds nothing, the caller
runs the matcher as before. A walk visits each matched node once, where torch's matcher
flattens every node's arguments and searches the users of its anchors for each further
output of a multi-output pattern.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.fx
from torch._inductor import pattern_matcher as pm

Node = torch.fx.Node


@dataclass(frozen=True)
class _Matched:
    """An argument that is the index-th node of the match."""

    index: int


@dataclass(frozen=True)
class _Bound:
    """An argument the match binds to the pattern's argument `name`."""

    name: str


class _Other:
    """An argument that is another node of the graph (a pattern's wildcard): any node."""


_OTHER = _Other()


@dataclass(frozen=True)
class _Call:
    op: str
    target: Any
    args: Any  # the node's args with each node as _Matched / _Bound / _OTHER
    kwargs: Any
    users: int


class _NoMatch(Exception):
    pass


@dataclass(frozen=True)
class MatchShape:
    """The structure of one exact match (see the module docstring)."""

    calls: tuple  # a _Call per matched node
    start: int  # the index of the node the match starts from (its first output)
    outputs: tuple  # (pattern output, index of its node or None), as the match's context has them
    names: tuple  # the bound argument names, grouped by the node they bind: ((a, b), (c,), ...)

    @staticmethod
    def of(match: pm.Match) -> Optional["MatchShape"]:
        """The shape of `match`, or None for a match it cannot describe (a bound value that
        is not a node)."""
        nodes = list(dict.fromkeys(match.nodes))
        index = {node: i for i, node in enumerate(nodes)}
        names_of: dict[Node, list[str]] = {}
        for name, value in match.kwargs.items():
            if not isinstance(value, Node) or value in index:
                return None
            names_of.setdefault(value, []).append(name)
        bound = {node: _Bound(names[0]) for node, names in names_of.items()}

        def template(value: Any) -> Any:
            if isinstance(value, Node):
                return _Matched(index[value]) if value in index else bound.get(value, _OTHER)
            if isinstance(value, (list, tuple)):
                return type(value)(template(v) for v in value)
            if isinstance(value, dict):
                return {k: template(v) for k, v in value.items()}
            return value

        calls = tuple(_Call(n.op, n.target, template(n.args), template(n.kwargs), len(n.users)) for n in nodes)
        outputs = tuple((pattern, None if node is None else index[node])
                        for pattern, node in zip(match.ctx.outputs, match.output_nodes()))
        start = next(i for _, i in outputs if i is not None)
        return MatchShape(calls, start, outputs, tuple(tuple(names) for names in names_of.values()))

    def find(self, node: Node) -> Optional[pm.Match]:
        """The match of this shape whose start is `node`, or None."""
        walk = _Walk(self)
        try:
            walk.assign(self.start, node)
            walk.run()
        except _NoMatch:
            return None
        return walk.match(node.graph)


class _Walk:
    """One attempt of MatchShape.find: nodes assigned to the shape's calls, and bindings."""

    def __init__(self, shape: MatchShape):
        self.shape = shape
        self.nodes: list[Optional[Node]] = [None] * len(shape.calls)
        self.index: dict[Node, int] = {}
        self.bound: dict[str, Node] = {}
        self.pending: list[int] = []

    def assign(self, i: int, node: Any) -> None:
        if not isinstance(node, Node) or node in self.index or node in self.bound.values():
            raise _NoMatch
        call = self.shape.calls[i]
        if node.op != call.op or node.target != call.target or len(node.users) != call.users:
            raise _NoMatch
        self.nodes[i] = node
        self.index[node] = i
        self.pending.append(i)

    def run(self) -> None:
        """Assign every call: from each assigned node along its arguments, then (for the
        calls no argument reaches: the other outputs of a multi-output pattern) from the
        users of an assigned or bound node. Where several users agree with a call, each is
        tried in turn, as torch's matcher tries each node its anchors lead to."""
        while True:
            while self.pending:
                i = self.pending.pop()
                call, node = self.shape.calls[i], self.nodes[i]
                self._unify(call.args, node.args)
                self._unify(call.kwargs, node.kwargs)
            choice = self._fewest_candidates()
            if choice is None:
                return
            missing, candidates = choice
            if len(candidates) == 1:
                self.assign(missing, candidates[0])
                continue
            for candidate in candidates:
                saved = list(self.nodes), dict(self.index), dict(self.bound)
                try:
                    self.assign(missing, candidate)
                    self.run()
                    return
                except _NoMatch:
                    self.nodes, self.index, self.bound = saved
                    self.pending = []
            raise _NoMatch

    def _fewest_candidates(self) -> Optional[tuple[int, list[Node]]]:
        """(a call not assigned yet, the nodes it can be), the first with at most one
        candidate or else the one with the fewest; None when every call is assigned."""
        best = None
        for i, node in enumerate(self.nodes):
            if node is not None:
                continue
            candidates = self._candidates(i)
            if candidates is None:
                continue  # nothing known around it yet
            if not candidates:
                raise _NoMatch
            if best is None or len(candidates) < len(best[1]):
                best = (i, candidates)
                if len(candidates) == 1:
                    break
        if best is None and any(node is None for node in self.nodes):
            raise _NoMatch  # calls no assigned node leads to
        return best

    def _unify(self, template: Any, value: Any) -> None:
        if isinstance(template, _Matched):
            assigned = self.nodes[template.index]
            if assigned is None:
                self.assign(template.index, value)
            elif assigned is not value:
                raise _NoMatch
        elif isinstance(template, _Bound):
            if not isinstance(value, Node) or value in self.index:
                raise _NoMatch
            if self.bound.setdefault(template.name, value) is not value:
                raise _NoMatch
        elif template is _OTHER:
            if not isinstance(value, Node):
                raise _NoMatch
        elif isinstance(template, (list, tuple)):
            if type(value) is not type(template) or len(value) != len(template):
                raise _NoMatch
            for t, v in zip(template, value):
                self._unify(t, v)
        elif isinstance(template, dict):
            if not isinstance(value, dict) or value.keys() != template.keys():
                raise _NoMatch
            for key, t in template.items():
                self._unify(t, value[key])
        elif type(value) is not type(template) or value != template:
            raise _NoMatch

    def _candidates(self, i: int) -> Optional[list[Node]]:
        """The nodes call i can be: users of the assigned or bound node among its arguments
        with the fewest users, with its op, target and user count, agreeing with it in every
        argument already known; None when none of its arguments is known yet."""
        call = self.shape.calls[i]
        known = self._known_arguments(call.args) + self._known_arguments(call.kwargs)
        if not known:
            return None
        source = min(known, key=lambda node: len(node.users))
        return [user for user in source.users
                if user not in self.index and user.op == call.op and user.target == call.target
                and len(user.users) == call.users and self._agrees(call, user)]

    def _known_arguments(self, template: Any) -> list[Node]:
        if isinstance(template, _Matched):
            node = self.nodes[template.index]
            return [node] if node is not None else []
        if isinstance(template, _Bound):
            return [self.bound[template.name]] if template.name in self.bound else []
        if isinstance(template, (list, tuple)):
            return [node for t in template for node in self._known_arguments(t)]
        if isinstance(template, dict):
            return [node for t in template.values() for node in self._known_arguments(t)]
        return []

    def _agrees(self, call: _Call, node: Node) -> bool:
        """`node`'s arguments agree with `call`'s as far as they are known (nothing assigned)."""
        return self._may_unify(call.args, node.args) and self._may_unify(call.kwargs, node.kwargs)

    def _may_unify(self, template: Any, value: Any) -> bool:
        if isinstance(template, _Matched):
            assigned = self.nodes[template.index]
            return assigned is value if assigned is not None else isinstance(value, Node) and value not in self.index
        if isinstance(template, _Bound):
            bound = self.bound.get(template.name)
            return bound is value if bound is not None else isinstance(value, Node) and value not in self.index
        if template is _OTHER:
            return isinstance(value, Node)
        if isinstance(template, (list, tuple)):
            return (type(value) is type(template) and len(value) == len(template)
                    and all(self._may_unify(t, v) for t, v in zip(template, value)))
        if isinstance(template, dict):
            return (isinstance(value, dict) and value.keys() == template.keys()
                    and all(self._may_unify(t, value[k]) for k, t in template.items()))
        return type(value) is type(template) and value == template

    def match(self, graph: torch.fx.Graph) -> Optional[pm.Match]:
        shape = self.shape
        if any(name not in self.bound for names in shape.names for name in names[:1]):
            return None
        kwargs = {name: self.bound[names[0]] for names in shape.names for name in names}
        if len({kwargs[names[0]] for names in shape.names}) != len(shape.names):
            return None  # two arguments the recorded match had apart bind one node here
        ctx = pm.MatchContext([pattern for pattern, _ in shape.outputs],
                              {pattern: self.nodes[i] for pattern, i in shape.outputs if i is not None},
                              graph=graph)
        match = pm.Match(ctx, shape.outputs[0][0], kwargs=kwargs)
        match.nodes = list(self.nodes)
        return match
