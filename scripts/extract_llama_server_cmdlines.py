"""Writes tests/data/llama_server_cmdlines.json: every llama-server command line in llama.cpp's
tools/server/README.md and every launch llama.cpp's server tests (tools/server/tests) make,
each with where it came from and whether kvshare must start with it or refuse it (and why).

    python3 scripts/extract_llama_server_cmdlines.py LLAMA_CPP_DIR [--write]

README lines are read from its fenced code blocks (`llama-server ...`, `./llama-server ...`,
`llama-server.exe ...`, the Docker images' arguments, the compose file's LLAMA_ARG_*
variables). Test launches are recorded by running llama.cpp's server tests (SLOW_TESTS=1)
under scripts/llama_server_cmdlines_plugin.py, which records each `ServerProcess.start()`'s
arguments and starts nothing. Launches with the same arguments (the port aside) are one entry
listing every test that makes it.

A line is refused when it carries a flag of REFUSE_CAPABILITY (a capability kvshare does not
have); a line naming no model (llama-server's router mode) is marked `router`; every other
line must start kvshare.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "tests" / "data" / "llama_server_cmdlines.json"

# llama-server flags whose lines kvshare refuses: flag -> the capability it needs
REFUSE_CAPABILITY = {
    "--embedding": "embeddings", "--embeddings": "embeddings", "--pooling": "embeddings",
    "--reranking": "reranking", "--rerank": "reranking",
    "--lora": "LoRA", "--lora-scaled": "LoRA",
    "--model-draft": "speculative decoding", "-md": "speculative decoding",
    "--spec-type": "speculative decoding", "--spec-draft-n-max": "speculative decoding",
    "--spec-draft-n-min": "speculative decoding", "--spec-synth-len": "speculative decoding",
    "--spec-synth-rates": "speculative decoding",
    "--mmproj": "multimodal", "--mmproj-url": "multimodal", "--no-mmproj": "multimodal",
    "--media-path": "multimodal",
}
# flags a README line uses that llama-server itself does not have (its parser exits on them)
NOT_LLAMA_FLAGS = {"-ctx": "none: -ctx is not a llama-server flag (-c is)"}
MODEL_FLAGS = ("-m", "--model", "-hf", "-hfr", "--hf-repo", "-mu", "--model-url")
MODEL_ENV = ("LLAMA_ARG_MODEL", "LLAMA_ARG_HF_REPO", "LLAMA_ARG_MODEL_URL")


def _fenced_blocks(text: str) -> list[tuple[int, str, list[str]]]:
    """(first line number, language, lines) of each fenced code block."""
    out, lang, start, cur = [], None, 0, None
    for i, line in enumerate(text.splitlines(), 1):
        m = re.match(r"^\s*```(\S*)", line)
        if m and cur is None:
            lang, start, cur = m.group(1), i + 1, []
        elif m:
            out.append((start, lang or "", cur))
            cur = None
        elif cur is not None:
            cur.append(line)
    return out


def readme_lines(llama: Path) -> list[dict]:
    path = llama / "tools" / "server" / "README.md"
    entries = []
    for start, lang, lines in _fenced_blocks(path.read_text()):
        env = {}
        for k, line in enumerate(lines):
            s = line.strip()
            where = f"tools/server/README.md:{start + k}"
            m = re.match(r"^(?:\./)?llama-server(\.exe)?(\s.*)?$", s)
            if m:
                rest = (m.group(2) or "").strip()
                argv = rest.split() if m.group(1) else shlex.split(rest)
                entries.append({"argv": argv, "env": {}, "sources": [where]})
                continue
            m = re.match(r"^docker run .*ghcr\.io/ggml-org/llama\.cpp:server\S*\s+(.*)$", s)
            if m:
                entries.append({"argv": shlex.split(m.group(1)), "env": {},
                                "sources": [where]})
                continue
            m = re.match(r"^(LLAMA_ARG_[A-Z_]+):\s*(\S+)$", s)
            if m and lang in ("yml", "yaml"):
                env[m.group(1)] = m.group(2)
        if env:
            entries.append({"argv": [], "env": env,
                            "sources": [f"tools/server/README.md:{start} (docker compose)"]})
    return entries


def test_launches(llama: Path) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        tests = Path(tmp) / "tests"
        shutil.copytree(llama / "tools" / "server" / "tests", tests)
        out = Path(tmp) / "records.json"
        env = {**os.environ, "SLOW_TESTS": "1", "KVSHARE_CMDLINES_OUT": str(out),
               "PYTHONPATH": os.pathsep.join([str(ROOT / "scripts"), str(tests)])}
        subprocess.run([sys.executable, "-m", "pytest", "-p", "llama_server_cmdlines_plugin",
                        "-p", "no:cacheprovider", "-q", "unit"], cwd=tests, env=env,
                       stdout=subprocess.DEVNULL, check=False)
        records = json.loads(out.read_text())
    merged: dict[str, dict] = {}
    for r in records:
        argv = [_placeholder(a, tests) for a in r["argv"]]
        i = argv.index("--port") if "--port" in argv else -1
        if i >= 0:
            argv[i + 1] = "8080"  # each test's port: one launch
        env = {k: ("8080" if k == "AIP_HTTP_PORT" else v) for k, v in r["env"].items()}
        key = json.dumps([argv, env])
        e = merged.setdefault(key, {"argv": argv, "env": env, "sources": []})
        e["sources"].append("tools/server/tests/" + r["test"])
    return list(merged.values())


def _placeholder(arg: str, tests: Path) -> str:
    """A recorded argument without this machine's paths in it."""
    arg = arg.replace(str(tests), "tools/server/tests").replace(sys.executable, "python3")
    return re.sub(r"/tmp/tmp[\w]+\.json", "/tmp/mcp.json", arg)


def classify(e: dict) -> dict:
    argv, env = e["argv"], e["env"]
    needs = {}
    for a in argv:
        name = a.split("=", 1)[0]
        if name.startswith("--"):
            name = name.replace("_", "-")
        if name in REFUSE_CAPABILITY:
            needs[name] = REFUSE_CAPABILITY[name]
        elif name in NOT_LLAMA_FLAGS:
            needs[name] = NOT_LLAMA_FLAGS[name]
    if needs:
        e["expect"] = "refuse"
        e["refused_flags"] = list(needs)
        e["capability"] = sorted(set(needs.values()))
    elif not any(a in MODEL_FLAGS for a in argv) and not any(k in env for k in MODEL_ENV):
        e["expect"] = "router"
        e["capability"] = ["router mode"]
    else:
        e["expect"] = "accept"
    return e


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("llama_cpp", type=Path, help="a llama.cpp checkout")
    ap.add_argument("--write", action="store_true", help=f"write {OUT.relative_to(ROOT)}")
    a = ap.parse_args()
    commit = subprocess.run(["git", "-C", str(a.llama_cpp), "rev-parse", "HEAD"],
                            capture_output=True, text=True).stdout.strip() or None
    entries = [classify(e) for e in readme_lines(a.llama_cpp) + test_launches(a.llama_cpp)]
    for i, e in enumerate(entries):
        e["id"] = f"readme-{i}" if e["sources"][0].startswith("tools/server/README") \
            else f"tests-{i}"
    doc = {"llama_cpp_commit": commit, "generator": "scripts/extract_llama_server_cmdlines.py",
           "launches_recorded": sum(len(e["sources"]) for e in entries
                                    if not e["sources"][0].startswith("tools/server/README")),
           "lines": entries}
    text = json.dumps(doc, indent=1) + "\n"
    if a.write:
        OUT.write_text(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
