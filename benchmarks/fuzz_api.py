"""Schemathesis over the server's typed /openapi.json: generated requests (bodies included), no 5xx.

    .venv/bin/pip install -e '.[fuzz]'        # schemathesis
    .venv/bin/python benchmarks/fuzz_api.py                      # 200 examples per operation
    .venv/bin/python benchmarks/fuzz_api.py --max-examples 500 --seed 1 -- --workers 2

It builds the tests' tiny random Llama (tests/tiny_models.py) in a temp folder, starts
``kvloom serve DIR --served-model-name tiny --max-model-len 256 --max-num-seqs 8`` on a free port
with no API key, and runs (with benchmarks/fuzz_hooks.py, which puts ``tiny`` in most bodies)

    schemathesis run http://127.0.0.1:PORT/openapi.json --checks not_a_server_error
        --max-examples N --seed S --request-timeout 60 --report ndjson ...

(arguments after ``--`` go to schemathesis). It prints the number of requests sent and the failures,
with each failing request's method, path and body, and exits 1 when schemathesis found a 5xx (or
a request that did not answer). The server's log is in ``.peers/logs/fuzz-server.log``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks" / "peers"))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def summarize(ndjson_path: Path) -> tuple[int, list[dict[str, object]]]:
    """(requests sent, failures) from schemathesis's ndjson event stream.

    A ScenarioFinished event carries the recorder of one test scenario: its interactions are the
    requests sent, its checks the results, ``status`` FAILURE on a failed check.
    """
    requests = 0
    failures: list[dict[str, object]] = []
    for line in ndjson_path.read_text().splitlines():
        event = json.loads(line)
        finished = event.get("ScenarioFinished")
        if not finished:
            continue
        recorder = finished.get("recorder") or {}
        interactions = recorder.get("interactions") or {}
        requests += len(interactions)
        for checks in (recorder.get("checks") or {}).values():
            for check in checks:
                if check.get("status") != "FAILURE":
                    continue
                case = (recorder.get("cases") or {}).get(check.get("case_id"), {}).get("value", {})
                interaction = interactions.get(check.get("case_id")) or {}
                response = interaction.get("response") or {}
                failures.append({"check": check.get("name"), "method": case.get("method"),
                                 "path": case.get("path"), "body": case.get("body"),
                                 "query": case.get("query"), "headers": case.get("headers"),
                                 "status": response.get("status_code"),
                                 "message": (check.get("failure_info") or {}).get("failure", {})})
    return requests, failures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-examples", type=int, default=200, help="test cases per API operation")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--report-dir", default=str(ROOT / "bench_results" / "fuzz_api"))
    parser.add_argument("schemathesis_args", nargs="*", help="after --: passed to schemathesis run")
    args = parser.parse_args()
    schemathesis = shutil.which("schemathesis", path=str(Path(sys.executable).parent)) or shutil.which("schemathesis")
    if schemathesis is None:
        raise SystemExit("schemathesis is not installed: .venv/bin/pip install -e '.[fuzz]'")

    import tiny_models

    from kvloom.bench.servers import Server

    with tempfile.TemporaryDirectory(prefix="kvloom-fuzz-") as tmp:
        model_dir = tiny_models.build_tiny_checkpoint(os.path.join(tmp, "tiny_llama"), arch="llama")
        port = free_port()
        server = Server("kvloom", port=port, num_seqs=8, max_model_len=256, extra=["--served-model-name", "tiny"],
                        log=str(ROOT / ".peers" / "logs" / "fuzz-server.log"), ready_timeout=120, model=model_dir)
        server.env["KVLOOM_API_KEY"] = ""
        report_dir = Path(args.report_dir)
        report_dir.mkdir(parents=True, exist_ok=True)
        ndjson = report_dir / "events.ndjson"
        command = [schemathesis, "run", f"{server.base_url}/openapi.json", "--checks", "not_a_server_error",
                   "--max-examples", str(args.max_examples), "--seed", str(args.seed),
                   "--request-timeout", "60", "--no-color", "--report", "ndjson",
                   "--report-ndjson-path", str(ndjson), *args.schemathesis_args]
        with server:
            print(f"kvloom on the tiny model at {server.base_url} (log {server.log_path})", flush=True)
            print(" ".join(command), flush=True)
            # fuzz_hooks.py: most bodies name the served model (see there).
            env = {**os.environ, "SCHEMATHESIS_HOOKS": "fuzz_hooks", "KVLOOM_FUZZ_MODEL": "tiny",
                   "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "benchmarks"),
                                                               os.environ.get("PYTHONPATH")]))}
            code = subprocess.call(command, env=env)
            alive = server.process is not None and server.process.poll() is None
    requests, failures = summarize(ndjson)
    print(f"\nrequests sent: {requests}; failed checks: {len(failures)}; server alive at the end: {alive}")
    for failure in failures:
        print(json.dumps(failure, default=str))
    return 1 if failures or code != 0 or not alive else 0


if __name__ == "__main__":
    sys.exit(main())
