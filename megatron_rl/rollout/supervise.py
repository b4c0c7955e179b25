"""Keep one disaggregated rollout server running: restart it when it dies.

    python -m megatron_rl.rollout.supervise --restarts 3 --failed-file F -- \\
        python -m megatron_rl.rollout.launch_server --slurm-slot ...

The sbatch script runs every server of its server step under this supervisor (one per Slurm task).
A server that exits on its own after it has run `--min-uptime` seconds (a crash, an out-of-memory
kill, a scheduler that died) is started again with the same command, on the same GPUs and port
(the slot is taken from the task's Slurm variables again), up to `--restarts` times in the run,
after a pause that doubles from `--pause` (2 s). The trainer drops an unreachable server from its weight pushes
and takes it back, with the current weights, at the first push after it answers
(rollout/fleet.py); the client does not send it requests before that (rollout/client.py).

Not restarted: a server that dies within `--min-uptime` of its start (bad arguments, a model that
does not fit: restarting would fail the same way), and one that has used up its restarts. The
supervisor then appends a line naming its task to `--failed-file`, which the sbatch script reads
while it waits for the servers to come up, and exits with the server's code; the other servers of
the step run on (the step has no --kill-on-bad-exit).

SIGTERM / SIGINT (srun ending the step) go to the server, and the supervisor exits when it has;
SIGUSR1 (the learner's preemption signal, which srun delivers to every process of the job's steps)
is ignored, as the server itself ignores it. Standard library only: no torch in this process.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time


def _say(message: str) -> None:
    task = os.environ.get("SLURM_PROCID", "?")
    print(f"[megatron-rl supervisor, task {task}] {time.strftime('%F %T')} {message}", flush=True)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv:
        raise SystemExit("usage: supervise [--restarts N] [--min-uptime S] [--failed-file F] -- COMMAND ...")
    cut = argv.index("--")
    parser = argparse.ArgumentParser(prog="python -m megatron_rl.rollout.supervise", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--restarts", type=int, default=3, help="restarts in the run (default 3)")
    parser.add_argument("--min-uptime", type=float, default=60.0,
                        help="a server that dies sooner after its start is not restarted (default 60 s)")
    parser.add_argument("--pause", type=float, default=2.0,
                        help="seconds before the first restart, doubling to at most 60 (default 2)")
    parser.add_argument("--failed-file", default=None, help="a line is appended here when a server is given up")
    args = parser.parse_args(argv[:cut])
    command = argv[cut + 1:]
    if not command:
        raise SystemExit("supervise: no command after --")
    if args.restarts < 0 or args.min_uptime < 0:
        raise SystemExit(f"supervise: --restarts {args.restarts} and --min-uptime {args.min_uptime} must be >= 0")

    child: list[subprocess.Popen] = []
    stopping = [False]

    def forward(signum, frame):  # noqa: ARG001
        stopping[0] = True
        if child and child[0].poll() is None:
            child[0].send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)

    restarts, pause = 0, args.pause
    while True:
        started = time.monotonic()
        child[:] = [subprocess.Popen(command)]
        code = child[0].wait()
        if stopping[0]:
            return 0 if code in (0, -signal.SIGTERM, -signal.SIGINT) else code
        uptime = time.monotonic() - started
        reason = f"signal {-code}" if code < 0 else f"exit code {code}"
        if uptime < args.min_uptime or restarts >= args.restarts:
            why = (f"it died {uptime:.0f}s after its start (--min-uptime {args.min_uptime:.0f}s)"
                   if uptime < args.min_uptime else f"its {args.restarts} restarts are used up")
            _say(f"server exited ({reason}); not restarted: {why}")
            if args.failed_file:
                with open(args.failed_file, "a") as f:
                    f.write(f"task {os.environ.get('SLURM_PROCID', '?')} on {os.uname().nodename}: {reason}; {why}\n")
            return code if code > 0 else 1
        restarts += 1
        _say(f"server exited ({reason}) after {uptime:.0f}s; restart {restarts} of {args.restarts} in {pause:g}s")
        time.sleep(pause)
        pause = min(2 * pause, 60.0)
        if stopping[0]:
            return 0


if __name__ == "__main__":
    sys.exit(main())
