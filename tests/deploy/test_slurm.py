"""deploy/slurm/lorasync.sbatch on a real single-node SLURM cluster (Debian's slurm-wlm: munged,
slurmctld and slurmd started here, as this user, in a temporary directory, and stopped after).

The job is the demo's, sized down: 2 replicas, the proxy and a 2-rank trainer (one srun step whose
SLURM variables the script maps to RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT), on the
demo's base model made here. The first submission is cancelled with `scancel` mid-run: the trainer
checkpoints inside KillWait. The second submission of the same script resumes and finishes. Checked:
every step is in metrics.jsonl exactly once, the run restarted once, and it learned (reward and
held-out accuracy of the final adapter against the base model's, by `lorasync eval`)."""
import getpass
import json
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
BINARY = os.environ.get("LORASYNC_BINARY", str(ROOT / "build" / "release" / "apps" / "lorasync" / "lorasync"))
SBATCH_SCRIPT = ROOT / "deploy" / "slurm" / "lorasync.sbatch"
STEPS = 80


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(what, cond, timeout, poll=0.2):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(poll)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


class Cluster:
    """munged + slurmctld + slurmd for one node named after this host, state in `root`."""

    def __init__(self, root):
        for tool in ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "scancel"):
            assert shutil.which(tool), f"{tool} is not installed: scripts/setup installs slurm-wlm and munge"
        self.root = root
        self.procs = []
        user = getpass.getuser()
        node = socket.gethostname().split(".")[0]
        munge = root / "munge"
        root.mkdir(parents=True)
        munge.mkdir(mode=0o700)
        (munge / "munge.key").write_bytes(os.urandom(1024))
        os.chmod(munge / "munge.key", 0o400)
        for d in ("state", "spool", "log"):
            (root / d).mkdir()
        self.sock = munge / "munge.socket"
        self.conf = root / "slurm.conf"
        self.conf.write_text(f"""ClusterName=lorasynctest
SlurmctldHost={node}(127.0.0.1)
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
SlurmUser={user}
SlurmdUser={user}
AuthType=auth/munge
AuthInfo=socket={self.sock}
CredType=cred/munge
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
MpiDefault=none
KillWait=60
NodeName={node} NodeAddr=127.0.0.1 CPUs={os.cpu_count()} RealMemory=1000 State=UNKNOWN
PartitionName=debug Nodes={node} Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
""")
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self.spawn(["munged", "-F", "-f", f"--socket={self.sock}", f"--key-file={munge / 'munge.key'}",
                    f"--log-file={root / 'log' / 'munged.log'}", f"--pid-file={munge / 'pid'}",
                    f"--seed-file={munge / 'seed'}"])
        wait_for("munged's socket", self.sock.exists, 30)
        self.spawn(["slurmctld", "-D", "-i", "-f", str(self.conf)])
        self.spawn(["slurmd", "-D", "-N", node, "-f", str(self.conf)])
        wait_for("the node to be idle", lambda: "idle" in self.run("sinfo", "-h", "-o", "%T").stdout, 60, 0.5)

    def spawn(self, argv):
        log = open(self.root / "log" / (pathlib.Path(argv[0]).name + ".stderr"), "w")
        self.procs.append(subprocess.Popen(argv, env=getattr(self, "env", os.environ), stdout=log, stderr=subprocess.STDOUT,
                                           start_new_session=True))

    def run(self, *argv, env=None, check=False):
        return subprocess.run(argv, env={**self.env, **(env or {})}, capture_output=True, text=True, check=check, timeout=60)

    def job_done(self, job):
        return not self.run("squeue", "-h", "-j", job).stdout.strip()

    def logs(self):
        out = []
        for f in sorted((self.root / "log").iterdir()):
            out.append(f"--- {f.name}\n{f.read_text(errors='replace')[-3000:]}")
        return "\n".join(out)

    def stop(self):
        self.run("scancel", "--user", getpass.getuser())
        for p in reversed(self.procs):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in reversed(self.procs):
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


def metrics(run):
    path = run / "train" / "metrics.jsonl"
    return [json.loads(l) for l in path.read_text().splitlines() if l.strip()] if path.exists() else []


def evaluate(demo, adapter=None):
    meta = json.loads((demo / "demo.json").read_text())
    argv = [BINARY, "eval", "--model", str(demo / "model"), "--data", str(demo / "heldout.jsonl"), "--samples", "2",
            "--temperature", "1.0", "--max-new-tokens", str(meta["max_new_tokens"]), "--limit", "200", "--seed", "7",
            "--system-prompt", meta["system_prompt"]]
    if adapter:
        argv += ["--adapter", str(adapter)]
    out = subprocess.run(argv, capture_output=True, text=True, check=True, timeout=300).stdout
    return json.loads(out.strip().splitlines()[-1])["accuracy"]


def test_demo_job_learns_across_scancel_and_resubmission(tmp_path):
    demo = tmp_path / "demo"
    subprocess.run([BINARY, "make-demo-model", "--out", str(demo), "--seed", "1", "--steps", "800"], check=True,
                   capture_output=True, timeout=900)
    run = tmp_path / "run"
    run.mkdir()
    cluster = Cluster(tmp_path / "slurm")
    try:
        job_env = {
            "LORASYNC_BIN": BINARY, "LORASYNC_RUN_DIR": str(run), "LORASYNC_MODEL": str(demo / "model"),
            "LORASYNC_CONFIG": str(ROOT / "deploy" / "slurm" / "demo-train.toml"), "LORASYNC_TRAINER_RANKS": "2",
            "LORASYNC_SERVE_ARGS": "--max-model-len 512 --kv-cache-memory 64MiB --threads 1 --max-loras 6 --dtype float32",
            "LORASYNC_TRAIN_ARGS": f'--set model.path="{demo / "model"}" --set data.train_file="{demo / "train.jsonl"}" '
                                   f"--set max_steps={STEPS}",
        }

        def submit():
            r = cluster.run("sbatch", "--parsable", "-n", "2", "-o", str(run / "job-%j.out"), str(SBATCH_SCRIPT),
                            env=job_env, check=True)
            return r.stdout.strip().split(";")[0]

        first = submit()
        try:
            wait_for("20 steps of the first job", lambda: len(metrics(run)) >= 20 or cluster.job_done(first), 600)
        except AssertionError:
            raise AssertionError(cluster.logs() + "\n" + "\n".join(f.read_text() for f in run.rglob("*.log")))
        assert not cluster.job_done(first), (run / f"job-{first}.out").read_text()
        cluster.run("scancel", first, check=True)
        wait_for("the first job to end", lambda: cluster.job_done(first), 180)
        done_first = len(metrics(run))
        assert done_first < STEPS, "the first job finished before it was cancelled"
        assert (run / "train" / "checkpoints" / "latest").exists(), (run / "slurm" / first / "trainer.log").read_text()[-3000:]
        assert "checkpoint" in (run / "slurm" / first / "trainer.log").read_text()

        second = submit()
        wait_for("the second job to end", lambda: cluster.job_done(second), 900, 0.5)
        out = (run / f"job-{second}.out").read_text()
        assert "resuming from" in out, out
        assert "trainer exited with 0" in out, out + (run / "slurm" / second / "trainer.log").read_text()[-3000:]
    finally:
        cluster.stop()

    ms = metrics(run)
    assert [m["step"] for m in ms] == list(range(1, STEPS + 1))  # every step once, across the two jobs
    assert ms[-1]["restarts"] == 1
    assert ms[-1]["rollout/failed_total"] == 0
    first10 = sum(m["reward"] for m in ms[:10]) / 10
    last10 = sum(m["reward"] for m in ms[-10:]) / 10
    assert last10 - first10 >= 0.2, (first10, last10)
    base, trained = evaluate(demo), evaluate(demo, run / "train" / "final_adapter")
    print(json.dumps({"slurm_demo": {"steps_first_job": done_first, "reward_first10": first10, "reward_last10": last10,
                                     "accuracy_base": base, "accuracy_trained": trained}}))
    assert trained - base >= 0.15, (base, trained)
