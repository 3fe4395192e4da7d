"""The tree budget (core.width.TreeBudget): how many nodes a tree draft gets beyond its width, priced by the pass,
and what the driver's Speculation teaches it and the width policy after a tree step."""

from __future__ import annotations

from ortspec.core import CostAwareWidth, DraftContext, Options
from ortspec.core.state import DecodeState
from ortspec.core.tree import DraftTree
from ortspec.core.width import FixedWidth, TreeBudget, tree_nodes
from ortspec.speculation import Speculation

STEEP = (1.0, *(1.0 + 0.5 * k for k in range(1, 17)))  # every node costs half a plain step
FLAT = (1.0, *(1.05 for _ in range(16)))  # nodes nearly free


def test_branches_that_add_nothing_leave_a_chain():
    budget = TreeBudget(STEEP, branch_tokens=0.0)
    assert budget.nodes_at(4) == 4 and budget.nodes_at(0) == 0


def test_cheap_nodes_that_pay_are_granted_up_to_the_branches_and_the_curve():
    budget = TreeBudget(FLAT, max_branches=3, branch_tokens=4.0, branch_nodes=8.0)
    assert budget.nodes_at(4) == 12  # 3 branches x 4 deep
    assert budget.nodes_at(8) == 16  # the curve's end
    assert TreeBudget(FLAT, max_branches=1).nodes_at(4) == 4


def test_a_chain_probes_with_twice_the_width_every_probe_every_steps():
    budget = TreeBudget(STEEP, branch_tokens=0.0, probe_every=3)
    for _ in range(2):
        budget = budget.observe(4, 2, 0, 0)
        assert budget.nodes_at(4) == (8 if budget.idle_steps + 1 >= 3 else 4)
    assert budget.idle_steps == 2 and budget.nodes_at(4) == 8
    assert budget.observe(4, 2, 4, 0).idle_steps == 0


def test_the_estimates_learn_from_each_step_and_plain_steps_change_nothing():
    budget = TreeBudget(FLAT, decay=0.5, chain_tokens=2.0, chain_passes=1.0, branch_tokens=1.0, branch_nodes=8.0)
    after = budget.observe(4, 3, 6, 2)
    assert (after.chain_tokens, after.chain_passes) == (1.0 + 4, 0.5 + 1)
    assert (after.branch_tokens, after.branch_nodes) == (0.5 + 2, 4.0 + 6)
    assert budget.observe(0, 0, 0, 0) is budget


def test_policies_size_trees_only_with_a_budget():
    assert tree_nodes(FixedWidth(4), 4) == 4 and tree_nodes(CostAwareWidth(FLAT), 4) == 4
    granted = FixedWidth(4, tree=TreeBudget(FLAT, branch_tokens=4.0))
    assert tree_nodes(granted, 4) == 16 and tree_nodes(granted, 0) == 0


def test_speculation_teaches_the_first_branch_to_the_policy_and_the_rest_to_the_tree_budget():
    class Tree:
        def propose(self, context: DraftContext) -> DraftTree:
            return DraftTree((5, 6, 7, 8), (-1, 0, -1, 2))  # first branch 5 6; another branch 7 8

    policy = CostAwareWidth(FLAT, tree=TreeBudget(FLAT))
    state = DecodeState.start((1, 2, 3), Options(max_tokens=32))
    speculation = Speculation.of(Tree(), policy, state, trees=True)
    context, draft = speculation.draft(state, 32)
    assert isinstance(draft, DraftTree) and context is not None and context.tree_budget >= 4
    learned = speculation.observe(context, draft, 2, (2, 3))  # the other branch was accepted whole
    want = policy.observe(2, 0)
    assert learned.policy.acceptance() == want.acceptance()  # the first branch alone: 0 of 2
    tree = learned.policy.tree
    assert tree is not None and tree.branch_tokens == policy.tree.branch_tokens * 0.85 + 2
    chain_learned = speculation.observe(context, draft, 2, (0, 1))  # the first branch accepted whole
    assert chain_learned.policy.acceptance() == policy.observe(2, 2).acceptance()


def test_in_a_batch_nodes_are_priced_by_the_pass_they_join():
    """Alone, a node costing half a step does not pay for a quarter token; in a batch whose pass prices a draft row
    at a tenth of a plain row it does; where a draft row costs a whole plain row (compute-bound), it does not."""
    budget = TreeBudget(STEEP, max_branches=3, chain_tokens=2.0, chain_passes=1.0, branch_tokens=2.0, branch_nodes=8.0)
    assert budget.nodes_at(4) == 4
    assert budget.nodes_at(4, plain_cost=0.2, token_cost=0.02) == 12
    assert budget.nodes_at(4, plain_cost=0.2, token_cost=0.2) == 4
    granted = CostAwareWidth(STEEP, tree=budget)
    assert tree_nodes(granted, 4, 0.2, 0.02) == 12 and tree_nodes(granted, 4) == 4
