"""Token-tree drafts: a trie of candidate continuations, verified in one target pass, and the rules of such a pass.

A ``DraftTree`` is a frozen value: ``tokens[j]`` is node ``j``'s token and ``parents[j]`` its parent, -1 for a child
of the root (the pending token, which every pass feeds first) or an earlier node's index, so the nodes are in
topological order and node ``j``'s path from the root is a candidate continuation. Shared prefixes are merged into
one node, so a tree of ``n`` nodes covers its branches with ``n`` verify rows. A chain (the draft every proposer made
before trees) is the tree with one branch: ``parents == (-1, 0, 1, ...)``.

The verify row of a tree step is ``(pending, *tokens)``: row 0 is the pending token, row ``j + 1`` node ``j``. Its
attention rule (``tree_mask``, the one place it is written) is that a row sees the context before the pending token,
itself and its ancestors, and nothing else, and its position is the pending token's plus its depth + 1, so each
row's logits are what plain decoding computes after that node's path.

The accept rule (``walk``) generalises a chain's: ``pick(0)`` from the base row; then, while the current node has a
child whose token equals the last pick, move to that child (the lowest-index one, when siblings repeat a token) and
pick from its row. The picks along that path are the candidates, committed by ``core/state.py``'s rules exactly as a
chain's are. Only the accepted path's KV is kept: its nodes were written at ``kv_len + 1 + node`` and belong at
``kv_len + 1 + depth`` (``StepOutcome.kept_nodes``; a backend's ``keep_path`` moves them).

Pure: no I/O, no devices; ``tree_mask`` returns a new numpy array.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import NamedTuple

import attrs
import numpy as np

from .checks import ArgumentError, is_int, token_ids
from .sampling import NonFiniteRow


def check_parents(parents: Sequence[object]) -> tuple[int, ...]:
    """``parents`` as a tuple of ints; ``ValueError`` (``ArgumentError`` naming ``draft``) unless every entry
    ``parents[j]`` is an int in ``[-1, j)``: -1 (the root, i.e. the pending token) or an earlier node."""
    out = []
    for j, p in enumerate(parents):
        if not is_int(p):
            raise ArgumentError("draft", f"draft tree: parents[{j}] = {p!r} is not an int")
        if not -1 <= int(p) < j:  # type: ignore[call-overload]
            earlier = "no earlier node" if j == 0 else f"an earlier node 0..{j - 1}"
            raise ArgumentError(
                "draft",
                f"draft tree: node {j}'s parent is {p}; a parent must be -1 (the root) or {earlier} "
                "(the nodes are in topological order)",
            )
        out.append(int(p))  # type: ignore[call-overload]
    return tuple(out)


def _tokens(value: Iterable[object]) -> tuple[int, ...]:
    return token_ids("draft", value)


@attrs.frozen
class DraftTree:
    """A draft of candidate continuations that share prefixes (module docstring). ``tokens``: node ``j``'s token id;
    ``parents``: node ``j``'s parent, -1 (the root: the pending token) or an earlier node. ``len(tree)`` is its node
    count, what a step's draft budget bounds. ``ValueError`` (``ArgumentError`` naming ``draft``) for tokens that
    are not ids, a ``parents`` of another length, or a parent that is not -1 or an earlier node."""

    tokens: tuple[int, ...] = attrs.field(converter=_tokens)
    parents: tuple[int, ...] = attrs.field(converter=check_parents)
    _depths: tuple[int, ...] = attrs.field(init=False, eq=False, repr=False)
    _children: tuple[tuple[int, ...], ...] = attrs.field(init=False, eq=False, repr=False)  # index node + 1

    def __attrs_post_init__(self) -> None:
        if len(self.parents) != len(self.tokens):
            raise ArgumentError(
                "draft",
                f"draft tree: {len(self.tokens)} tokens but {len(self.parents)} parents (one parent per node)",
            )
        depths: list[int] = []
        children: list[list[int]] = [[] for _ in range(len(self.tokens) + 1)]
        for j, p in enumerate(self.parents):
            depths.append(0 if p < 0 else depths[p] + 1)
            children[p + 1].append(j)
        object.__setattr__(self, "_depths", tuple(depths))
        object.__setattr__(self, "_children", tuple(tuple(c) for c in children))

    @classmethod
    def chain(cls, tokens: Iterable[int]) -> DraftTree:
        """The tree with one branch: ``tokens`` in order, each node the child of the one before."""
        ids = tuple(tokens)
        return cls(ids, tuple(range(-1, len(ids) - 1)))

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def depths(self) -> tuple[int, ...]:
        """Node ``j``'s depth: 0 for a child of the root, its parent's + 1 otherwise. Its verify row's position is
        the pending token's + 1 + depth."""
        return self._depths

    def children(self, node: int) -> tuple[int, ...]:
        """The children of ``node`` (-1: the root), lowest index first. ``IndexError`` for a node outside
        ``[-1, len(tree))``."""
        if not -1 <= node < len(self.tokens):
            raise IndexError(f"node {node} is outside [-1, {len(self.tokens)})")
        return self._children[node + 1]

    def child_with(self, node: int, token: int) -> int | None:
        """The lowest-index child of ``node`` (-1: the root) whose token is ``token``; None when there is none."""
        tokens = self.tokens
        return next((c for c in self._children[node + 1] if tokens[c] == token), None)

    @property
    def is_chain(self) -> bool:
        """True when the tree has one branch (``parents == (-1, 0, 1, ...)``); the empty tree is a chain."""
        return all(p == j - 1 for j, p in enumerate(self.parents))

    def cut(self, n: int) -> DraftTree:
        """The first ``n`` nodes (all of them when there are fewer): a valid tree, since parents come first."""
        if n >= len(self.tokens):
            return self
        n = max(n, 0)
        return DraftTree(self.tokens[:n], self.parents[:n])

    @classmethod
    def merged(cls, branches: Sequence[Sequence[int]], limit: int) -> DraftTree:
        """The trie of ``branches`` (candidate continuations, the likeliest first) with at most ``limit`` nodes: the
        first branch whole (as far as ``limit`` reaches), then the others level by level (every other branch's
        first token, then every one's second, ...), shared prefixes one node. So the first branch is
        ``first_branch()`` and a prefix of what a chain of ``limit`` tokens would draft, and the nodes beyond it are
        spread over the other branches' depths evenly."""
        tokens: list[int] = []
        parents: list[int] = []

        def node_for(parent: int, token: int) -> int | None:
            found = next((j for j, p in enumerate(parents) if p == parent and tokens[j] == token), None)
            if found is None and len(tokens) < limit:
                tokens.append(token)
                parents.append(parent)
                found = len(tokens) - 1
            return found

        if not branches:
            return cls((), ())
        parent: int | None = -1
        for token in branches[0][: max(limit, 0)]:
            parent = node_for(parent, int(token)) if parent is not None else None
        at: list[int | None] = [-1] * len(branches)  # each other branch's node at the level before; None: ended
        depth = 0
        while len(tokens) < limit:
            progressed = False
            for i in range(1, len(branches)):
                branch, parent = branches[i], at[i]
                at[i] = None if parent is None or depth >= len(branch) else node_for(parent, int(branch[depth]))
                progressed = progressed or at[i] is not None
            if not progressed:
                break
            depth += 1
        return cls(tuple(tokens), tuple(parents))

    @classmethod
    def with_siblings(
        cls, chain: Sequence[int], siblings: Sequence[Sequence[tuple[int, float]]], limit: int
    ) -> DraftTree:
        """``chain`` (the first branch, cut to ``limit`` nodes) and, in the nodes left, the likeliest ``siblings``
        as leaves: ``siblings[d]`` lists ``(token, chance)`` candidates for depth ``d`` beside ``chain[d]``
        (children of chain node ``d - 1``; of the root for ``d = 0``), ``chance`` the estimated probability that the
        walk reaches depth ``d`` and takes that token. Taken by chance, highest first (ties: the shallower, then the
        earlier listed); a candidate at a depth the cut chain does not reach, or whose token its parent already has
        as a child, is skipped. The nodes are the chain's, then the siblings' in the order taken, so the first
        branch is the cut chain."""
        tokens = [int(t) for t in chain[: max(limit, 0)]]
        depth = len(tokens)
        candidates = [
            (-float(chance), d, i, int(token))
            for d, listed in enumerate(siblings[:depth])
            for i, (token, chance) in enumerate(listed)
        ]
        parents = list(range(-1, depth - 1))
        taken = {(d - 1, tokens[d]) for d in range(depth)}
        for _, d, _, token in sorted(candidates):
            if len(tokens) >= limit:
                break
            if (d - 1, token) not in taken:
                taken.add((d - 1, token))
                tokens.append(token)
                parents.append(d - 1)
        return cls(tuple(tokens), tuple(parents))

    def within(self, nodes: int, depth: int) -> DraftTree:
        """The tree cut to its first ``nodes`` nodes of depth below ``depth`` (so its paths are at most ``depth``
        tokens long): a valid tree, since a node's ancestors come before it and are shallower."""
        keep = [j for j in range(len(self.tokens)) if self._depths[j] < depth][: max(nodes, 0)]
        if len(keep) == len(self.tokens):
            return self
        index = {j: i for i, j in enumerate(keep)}
        return DraftTree(tuple(self.tokens[j] for j in keep), tuple(index.get(self.parents[j], -1) for j in keep))

    def first_branch_nodes(self) -> tuple[int, ...]:
        """The nodes of ``first_branch()``, in depth order: from the root, each node's first (lowest-index) child."""
        path: list[int] = []
        node = -1
        while kids := self._children[node + 1]:
            node = kids[0]
            path.append(node)
        return tuple(path)

    def first_branch(self) -> DraftTree:
        """The chain of first children from the root: the branch a backend that cannot run trees verifies."""
        return DraftTree.chain(self.tokens[j] for j in self.first_branch_nodes())

    def after(self, prefix: Sequence[int]) -> DraftTree:
        """This tree drafted after ``prefix`` (tokens drafted in front of it, such as a grammar's forced ones): the
        chain of ``prefix`` first, then this tree's nodes, its root's children hung from the chain's last node."""
        n = len(prefix)
        shifted = (p + n if p >= 0 else n - 1 for p in self.parents)
        return DraftTree((*prefix, *self.tokens), (*range(-1, n - 1), *shifted))

    def below(self, n: int) -> DraftTree:
        """The tree after its first ``n`` nodes, which must be a chain from the root that every later node descends
        from (what ``after`` makes, cut or not): nodes ``n ..`` with the chain's last node as their root.
        ``ValueError`` for a tree of another shape."""
        if n <= 0:
            return self
        head, rest = self.parents[:n], self.parents[n:]
        if head != tuple(range(-1, n - 1)) or any(p < n - 1 for p in rest):
            raise ArgumentError("draft", f"draft tree: its first {n} nodes are not a chain that the others hang from")
        return DraftTree(self.tokens[n:], tuple(p - n if p >= n else -1 for p in rest))

    def path(self, node: int) -> tuple[int, ...]:
        """The nodes from the root's child down to ``node`` (inclusive), in depth order; () for the root (-1)."""
        out: list[int] = []
        while node >= 0:
            out.append(node)
            node = self.parents[node]
        return tuple(reversed(out))

    def before(self, row: int) -> tuple[int, ...]:
        """The draft tokens before verify row ``row`` (0: the pending token's row, ``j + 1``: node ``j``'s): the
        tokens of node ``row - 1``'s path, which a chain's row ``i`` reads as ``draft[:i]``."""
        return tuple(self.tokens[j] for j in self.path(row - 1))


def tree_mask(parents: Sequence[int]) -> np.ndarray:
    """The attention rule of a tree's verify row ``(pending, *nodes)``: bool ``[n + 1, n + 1]`` for ``n =
    len(parents)``, entry ``[a, b]`` True iff row ``b`` is row ``a`` or one of its ancestors (row 0: the pending
    token, every row's ancestor; row ``j + 1``: node ``j``). Every row also sees the slot's positions before the
    pending token. For a chain it is the causal (lower-triangular) mask. ``ValueError`` for invalid ``parents``."""
    ids = check_parents(parents)
    n = len(ids)
    mask = np.eye(n + 1, dtype=bool)
    mask[:, 0] = True
    for j, p in enumerate(ids):
        mask[j + 1] |= mask[p + 1]
    return mask


class Walk(NamedTuple):
    """The accept rule's answer over a tree: ``candidates``, the picks along the accepted path (``pick(0)``, then
    one per accepted node); ``path``, the accepted nodes in depth order (``candidates[d]`` equals node
    ``path[d]``'s token); ``rows``, each candidate's verify row (0, then ``path[d] + 1``); ``nonfinite_cut``: the
    last accepted node's row was not finite where its pick is made (so no candidate follows it)."""

    candidates: list[int]
    path: tuple[int, ...]
    rows: tuple[int, ...]
    nonfinite_cut: bool


def walk_chain(draft: Sequence[int], pick: Callable[[int], int]) -> Walk:
    """The accept rule over a chain (a tree with one branch, walked without building one): picks[0], then picks[i]
    while the draft agreed with every pick before it. A non-finite row after the first ends the block before it;
    the next step is plain and refuses it there, as plain decoding would."""
    k = len(draft)
    candidates: list[int] = [pick(0)]
    nonfinite_cut = False
    while len(candidates) <= k and candidates[-1] == draft[len(candidates) - 1]:
        try:
            candidates.append(pick(len(candidates)))
        except NonFiniteRow:
            nonfinite_cut = True
            break
    accepted = len(candidates) if nonfinite_cut else len(candidates) - 1  # draft tokens among the candidates
    return Walk(candidates, tuple(range(accepted)), tuple(range(len(candidates))), nonfinite_cut)


def walk(tree: DraftTree, pick: Callable[[int], int]) -> Walk:
    """The accept rule (module docstring) with ``pick(row)``, the target's pick from verify row ``row``, which
    raises ``NonFiniteRow`` where the row is not finite: raised from row 0, it propagates (a plain step's error);
    from a node's row, the walk ends before it (``nonfinite_cut``)."""
    candidates = [pick(0)]
    path: list[int] = []
    node = -1
    while (child := tree.child_with(node, candidates[-1])) is not None:
        path.append(child)
        try:
            candidates.append(pick(child + 1))
        except NonFiniteRow:
            return Walk(candidates, tuple(path), (0, *(j + 1 for j in path[:-1])), True)
        node = child
    return Walk(candidates, tuple(path), (0, *(j + 1 for j in path)), False)


# A step's draft: a chain (token ids in order) or a tree.
Draft = tuple[int, ...] | DraftTree
