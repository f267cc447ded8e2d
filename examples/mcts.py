#!/usr/bin/env python3
"""Tree search over sandboxes: an MCTS-style harness on the Planarian SDK.

Each node of the search tree is a statepoint of a sandbox. Expanding a node forks its statepoint
once per candidate but one, in the background while the (simulated) model proposes the
candidates, and the node's own sandbox takes the last candidate; each child runs its candidate
command, is scored by a check inside its sandbox, and takes a statepoint of its own. The score is backed up: every ancestor's statepoint gets an outcome with the reward,
so the root's ledger tells a person (or the model) which ways were tried and how they did.
Sandboxes no node of the best path lives in are pruned: removed with their statepoints.

The task here is small and has one best path, so a test can check the search finds it: a value in
/work/value starts at 1, the candidate commands add 3 or double it, the goal is 11 in the fewest
steps (+3, x2, +3). A real harness puts a model's proposals and a test suite in the same places.

    PYTHONPATH=python examples/mcts.py IMAGE [--name PREFIX] [--think SECONDS] [--json]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))

from planarian import ForkError, Handle, Sandbox  # noqa: E402

GOAL = 11
CANDIDATES = {
    "+3": "v=$(cat /work/value) && echo $((v + 3)) > /work/value",
    "x2": "v=$(cat /work/value) && echo $((v * 2)) > /work/value",
}
# The check a candidate's result is scored by, run in its sandbox: the value, and whether the
# background worker started with the task is still there (a child that lost it scores nothing).
CHECK = "cat /work/value; kill -0 $(cat /tmp/worker.pid) && echo worker-alive"


def reward_of(check_output: str) -> float:
    lines = check_output.split()
    if "worker-alive" not in lines:
        return -1.0
    value = int(lines[0])
    return 1.0 if value == GOAL else -abs(GOAL - value) / GOAL


@dataclass
class Node:
    sandbox: Sandbox
    statepoint: Handle
    path: List[str]
    reward: float = 0.0
    visits: int = 1
    total: float = 0.0
    parent: Optional["Node"] = None
    children: List["Node"] = field(default_factory=list)

    def ucb(self, c: float) -> float:
        assert self.parent is not None
        return self.total / self.visits + c * math.sqrt(math.log(self.parent.visits) / self.visits)


class SimulatedModel:
    """Stands in for an LLM call: takes its think time and proposes the candidate commands."""

    def __init__(self, think: float):
        self.think = think
        self.calls = 0

    def propose(self, node: Node) -> List[str]:
        self.calls += 1
        time.sleep(self.think)  # the model thinking: the forks are made meanwhile
        return list(CANDIDATES)


def search(root_sandbox: Sandbox, prefix: str, model: SimulatedModel, created: List[Sandbox], budget: int = 6, c: float = 0.5) -> Dict:
    started = time.monotonic()
    root_sp = root_sandbox.snapshot(name="task", description=f"value 1, goal {GOAL}", state={"value": 1}, wait=True)
    root = Node(root_sandbox, root_sp, [])
    forks, fork_wait, think = 0, 0.0, 0.0
    solved: Optional[Node] = None
    for _ in range(budget):
        # Selection: down the expanded nodes by UCB to a leaf.
        node = root
        while node.children:
            node = max(node.children, key=lambda ch: ch.ucb(c))
        # Expansion: the leaf's statepoint forked once per candidate but the last, in the
        # background while the model proposes; the leaf's own sandbox (still at its statepoint:
        # only read-only checks ran since) takes the last candidate.
        names = [f"{prefix}-{len(created) + i + 1}" for i in range(len(CANDIDATES) - 1)]
        node.statepoint.result()  # its snapshot was taken in the background
        t0 = time.monotonic()
        pending = node.sandbox.fork_async(node.statepoint.id, names=names)
        proposals = model.propose(node)
        t1 = time.monotonic()
        results = pending.result()
        t2 = time.monotonic()
        think += t1 - t0
        fork_wait += t2 - t1
        for r in results:
            if isinstance(r, ForkError):
                raise r
        forked = [r for r in results if isinstance(r, Sandbox)]
        created.extend(forked)
        forks += len(forked)
        for proposal, child_sb in zip(proposals, [*forked, node.sandbox]):
            # Simulation: run the candidate and score it; the child keeps a statepoint of its own.
            child_sb.exec(CANDIDATES[proposal])
            reward = reward_of(child_sb.exec(CHECK).output)
            # (in the background: the next child's commands run meanwhile)
            h = child_sb.snapshot(description=f"after {' '.join(node.path + [proposal])}", state={"path": node.path + [proposal], "reward": reward})
            child = Node(child_sb, h, node.path + [proposal], reward=reward, total=reward, parent=node)
            node.children.append(child)
            # Backpropagation: every ancestor's statepoint records the reward.
            status = "success" if reward == 1.0 else "info"
            a: Optional[Node] = node
            while a is not None:
                a.visits += 1
                a.total += reward
                a.sandbox.append_outcome(a.statepoint.id, f"{' '.join(child.path)} scored {reward:.2f}", status, reward=reward)
                a = a.parent
            if reward == 1.0 and (solved is None or len(child.path) < len(solved.path)):
                solved = child
        if solved is not None:
            break
    best = solved or max(_all(root), key=lambda n: n.reward)
    # Pruning: every sandbox no node of the best path lives in goes, with its statepoints.
    path = _ancestry(best)
    keep = {id(n.sandbox) for n in path}
    removed = []
    for n in _all(root):
        n.statepoint.result()
        if id(n.sandbox) not in keep and n.sandbox in created:
            n.sandbox.rm()
            created.remove(n.sandbox)
            removed.append(n.sandbox.name)
    # The root keeps its task statepoint (the ledger of the search) and the path's sandboxes theirs.
    return {
        "path": best.path,
        "reward": best.reward,
        "sandbox": best.sandbox.name,
        "statepoint": best.statepoint.id,
        "path-sandboxes": list(dict.fromkeys(n.sandbox.name for n in path)),
        "removed": removed,
        "forks": forks,
        "model-calls": model.calls,
        "think-s": round(think, 2),
        "waited-for-forks-s": round(fork_wait, 2),
        "total-s": round(time.monotonic() - started, 2),
        "root-statepoint": root.statepoint.id,
        "root-ledger": root.sandbox.ledger(text=True),
    }


def _all(root: Node) -> List[Node]:
    out, stack = [], [root]
    while stack:
        n = stack.pop()
        out.append(n)
        stack.extend(n.children)
    return out


def _ancestry(n: Optional[Node]) -> List[Node]:
    out = []
    while n is not None:
        out.append(n)
        n = n.parent
    return out[::-1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("image")
    ap.add_argument("--name", default="mcts")
    ap.add_argument("--think", type=float, default=2.0, help="the simulated model's think time per call (s)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--keep", action="store_true", help="leave the best path's sandboxes running")
    a = ap.parse_args()
    root = Sandbox.run(a.image, name=a.name, network="none", command=("sh", "-c", "mkdir -p /work && echo 1 > /work/value && sh -c 'echo $$ > /tmp/worker.pid; exec sleep 100000' & exec sleep 100000"))
    created: List[Sandbox] = []
    try:
        # The task is ready when its worker runs (waited for, not slept for).
        deadline = time.monotonic() + 120
        while not root.exec("kill -0 $(cat /tmp/worker.pid 2>/dev/null) 2>/dev/null && cat /work/value").ok:
            if time.monotonic() > deadline:
                raise SystemExit("the task's worker did not start within 120 s")
            time.sleep(0.2)
        result = search(root, a.name, SimulatedModel(a.think), created)
        if a.json:
            print(json.dumps(result))
        else:
            print(result["root-ledger"])
            print(f"best path: {' '.join(result['path'])} (reward {result['reward']:.2f}) in {result['sandbox']} at {result['statepoint']}")
            print(f"{result['forks']} forks, {result['model-calls']} model calls; forks waited for after thinking: {result['waited-for-forks-s']} s of {result['total-s']} s")
    finally:
        if not a.keep:
            for sb in [*created, root]:
                try:
                    sb.rm()
                except Exception as e:  # the others still go
                    print(f"mcts: {sb.name}: {e}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
