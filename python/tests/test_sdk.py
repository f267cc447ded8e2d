"""The SDK without containers: the command lines it builds and how it reads answers and
failures, against stand-in `planarian` and `podman` scripts that record their arguments. (The
real path is tested in the guest: tests/tests/sdk.rs.)"""

import json
import os
import stat
import sys
import tempfile
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from planarian import Busy, ForkError, NotRunning, PlanarianError, RestoreContext, Sandbox, UnknownStatepoint, _Cli  # noqa: E402


def script(dir: str, name: str, body: str) -> str:
    path = os.path.join(dir, name)
    with open(path, "w") as f:
        f.write("#!/bin/sh\n" + body + "\n")
    os.chmod(path, os.stat(path).st_mode | stat.S_IXUSR)
    return path


CONTEXT = {
    "operation": "rollback",
    "container": "agent",
    "statepoint": {"id": "sp2", "name": "deps", "description": "installed"},
    "restored": ["processes and memory (CRIU restore)", "files (zfs)"],
    "compensated": [],
    "discarded-statepoints": ["sp3"],
    "reason": "broke it",
    "prior-outcomes": [],
    "time": "t",
    "text": "[planarian] The sandbox agent was rolled back to statepoint sp2 \"deps\".\n",
    "not-held": ["process 9 (sleep 700): it runs outside the container's process tree"],
}


class CommandLines(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp()
        self.log = os.path.join(self.dir, "argv")
        # Each stand-in appends its argv (one per line) and answers from $ANSWER.
        body = f'printf "%s\\n" "$0 $*" >> {self.log}; if [ -n "$FAIL" ]; then echo "planarian: $FAIL" >&2; exit 1; fi; printf "%s" "$ANSWER"'
        self.cli = _Cli(planarian=script(self.dir, "planarian", body), podman=script(self.dir, "podman", body))

    def calls(self):
        with open(self.log) as f:
            return [line.split(" ", 1)[1].strip() if " " in line else "" for line in f.read().splitlines()]

    def answer(self, text="", fail=""):
        os.environ["ANSWER"] = text
        os.environ["FAIL"] = fail

    def test_run_snapshot_rollback_and_outcomes_build_the_command_lines(self):
        self.answer("0123abcd\n")
        sb = Sandbox.run("img", name="agent", network="none", env=["A=1", "B=2"], tty=True, cli=self.cli)
        self.assertEqual(sb.name, "agent")
        self.answer("sp4\n")
        h = sb.snapshot(name="deps", description="installed", state={"step": 2})
        self.assertEqual(h.id, "sp4")
        self.answer(json.dumps(CONTEXT))
        ctx = sb.rollback("sp2", reason="broke it")
        self.assertIsInstance(ctx, RestoreContext)
        self.assertEqual((ctx.statepoint["id"], ctx.discarded_statepoints), ("sp2", ["sp3"]))
        self.assertEqual((ctx.uncovered, ctx.not_held[0][:9]), ([], "process 9"))
        self.assertTrue(ctx.text.startswith("[planarian] The sandbox agent was rolled back"))
        self.answer("")
        sb.append_outcome("sp2", "tests fail", "failure", reward=-1)
        self.assertEqual(
            self.calls(),
            [
                "--runtime planarian run -d --name agent --network none --env A=1 --env B=2 --tty img sleep infinity",
                "snapshot agent --async --name deps --description installed --state -",
                "rollback agent sp2 --by harness --json --reason broke it",
                "statepoint set agent sp2 --outcome tests fail --status failure --by harness --reward -1.0",
            ],
        )
        with self.assertRaises(ValueError):
            sb.append_outcome("sp2", "x", "great")

    def test_failures_carry_the_one_line_and_are_typed(self):
        sb = Sandbox("agent", self.cli)
        self.answer(fail="unknown statepoint sp9 (see `planarian statepoint list`)")
        with self.assertRaises(UnknownStatepoint) as e:
            sb.rollback("sp9")
        self.assertEqual(str(e.exception), "unknown statepoint sp9 (see `planarian statepoint list`)")
        self.answer(fail="container agent is not running (it is exited)")
        with self.assertRaises(NotRunning):
            sb.snapshot()
        self.answer(fail="another statepoint operation or tool call is running in agent; try again when it has finished")
        with self.assertRaises(Busy):
            sb.rollback("sp1")
        self.answer(fail="anything else")
        with self.assertRaises(PlanarianError):
            sb.statepoints()

    def test_fork_gives_one_result_per_fork(self):
        sb = Sandbox("agent", self.cli)
        # Refused as a whole: every fork says why.
        self.answer(fail="a container named agent-fork-1 already exists")
        results = sb.fork("sp1", count=2)
        self.assertEqual(len(results), 2)
        self.assertTrue(all(isinstance(r, ForkError) for r in results))
        self.assertEqual(str(results[0]), "a container named agent-fork-1 already exists")
        # One call for all of them; without names the CLI names each fork (a spare keeps its own).
        self.assertEqual(self.calls()[-1], "fork agent sp1 --count 2 --by harness --json")
        spare = dict(CONTEXT, operation="fork", container="agent-spare-sp1-1", how={"path": "spare"})
        self.answer(json.dumps([spare]))
        (s,) = sb.fork("sp1")
        self.assertEqual((s.name, s.context.how), ("agent-spare-sp1-1", {"path": "spare"}))
        # One fork failed, the other made: one result each, in order.
        made = dict(CONTEXT, operation="fork", container="b")
        self.answer(json.dumps([made, {"container": "c", "error": "fork failed, nothing was created: disk full"}]))
        b, c = sb.fork("sp1", names=["b", "c"])
        self.assertEqual((b.name, b.context.operation), ("b", "fork"))
        self.assertIsInstance(c, ForkError)
        self.assertEqual(str(c), "fork failed, nothing was created: disk full")
        self.assertEqual(self.calls()[-1], "fork agent sp1 --count 2 --by harness --json --name b --name c")
        with self.assertRaises(ValueError):
            sb.fork("sp1", count=2, names=["only-one"])

    def test_fork_async_answers_at_once_and_its_result_is_the_forks(self):
        sb = Sandbox("agent", self.cli)
        self.answer(json.dumps([dict(CONTEXT, operation="fork", container=n) for n in ("c", "d")]))
        future = sb.fork_async("sp1", names=["c", "d"])
        results = future.result(timeout=60)
        self.assertEqual([r.name for r in results], ["c", "d"])
        self.assertEqual(self.calls()[-1], "fork agent sp1 --count 2 --by harness --json --name c --name d")

    def test_spare_asks_for_a_count_and_returns_the_names(self):
        sb = Sandbox("agent", self.cli)
        self.answer("agent-spare-sp1-1 (0123456789ab, frozen)\nagent-spare-sp1-2 (ba9876543210, frozen)\n")
        self.assertEqual(sb.spare("sp1", 2), ["agent-spare-sp1-1", "agent-spare-sp1-2"])
        self.answer("")
        self.assertEqual(sb.spare_async("sp1", 0).result(timeout=60), [])
        self.assertEqual(self.calls()[-2:], ["spare agent sp1 --count 2", "spare agent sp1 --count 0"])
        self.answer(json.dumps([dict(CONTEXT, operation="fork", container="e", how={"path": "spare"})]))
        (e,) = sb.fork("sp1", names=["e"])
        self.assertEqual(e.context.how, {"path": "spare"})


class Installed(unittest.TestCase):
    """The SDK as a user installs it (`pip install ./python`), imported from elsewhere: every
    module the source tree has is in the installed package (planarian.contrib once was not)."""

    def test_pip_install_ships_every_module(self):
        import shutil
        import subprocess

        src = os.path.join(os.path.dirname(__file__), "..")
        with tempfile.TemporaryDirectory() as tmp:
            # (as a user installs it, build isolation and all; from a copy: a build writes build/ and
            # *.egg-info beside the sources)
            copy = shutil.copytree(src, os.path.join(tmp, "src"), ignore=shutil.ignore_patterns("tests", "build", "*.egg-info", "__pycache__"))
            site = os.path.join(tmp, "site")
            subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-deps",
                            "--target", site, copy], check=True)
            ours = sorted(os.path.relpath(os.path.join(d, f), os.path.join(src))
                          for d, _, fs in os.walk(os.path.join(src, "planarian")) if "__pycache__" not in d for f in fs if f.endswith(".py"))
            installed = sorted(os.path.relpath(os.path.join(d, f), site)
                               for d, _, fs in os.walk(os.path.join(site, "planarian")) if "__pycache__" not in d for f in fs if f.endswith(".py"))
            self.assertEqual(installed, ours)
            # Imported from another directory with only the installed package on the path (the
            # contrib module itself needs mini-swe-agent's pydantic: found, not imported, here).
            probe = ("import importlib.util, planarian, planarian.contrib; "
                     "spec = importlib.util.find_spec('planarian.contrib.minisweagent'); "
                     "print(planarian.__file__); print(spec.origin)")
            out = subprocess.run([sys.executable, "-I", "-c", f"import sys; sys.path.insert(0, {site!r}); {probe}"],
                                 cwd=tmp, check=True, capture_output=True, text=True).stdout.split()
            self.assertEqual(out, [os.path.join(site, "planarian", "__init__.py"), os.path.join(site, "planarian", "contrib", "minisweagent.py")])


if __name__ == "__main__":
    unittest.main()
