#!/usr/bin/env python3
"""llama.cpp's own renderings of its built-in chat templates, for the test that checks
kvshare's Jinja versions of them (`kvshare.model.builtin_templates`):
`tests/data/chat_templates_reference.json`.

    python scripts/make_chat_template_reference.py --llama-cpp PATH/TO/llama.cpp \\
        --out tests/data/chat_templates_reference.json

llama.cpp side: a small tool (`APPLY_CPP`, compiled with g++ against a llama.cpp build's
shared libraries, e.g. the llama.cpp that `llama-cpp-python`'s sdist vendors, built with
`cmake -B build -DBUILD_SHARED_LIBS=ON -DLLAMA_CURL=OFF && cmake --build build --target llama`)
lists the names `llama_chat_builtin_templates` knows and renders each conversation below with
`llama_chat_apply_template(name, ...)` (the C++ renderings of `src/llama-chat.cpp`, which
llama-server uses for `--chat-template NAME` with `--no-jinja`), with and without the
generation prompt.

The file holds the conversations, the llama.cpp version it came from, and per name, per
conversation, per `add_generation_prompt` the rendered text.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
from pathlib import Path

# llama.cpp's own test conversation (tests/test-chat-template.cpp), one without a system
# message, and one whose contents carry surrounding whitespace (templates that trim differ).
CONVERSATIONS: dict[str, list[dict[str, str]]] = {
    "llama_cpp_test": [
        {"role": "system", "content": "You are a helpful assistant"},
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hi there"},
        {"role": "user", "content": "Who are you"},
        {"role": "assistant", "content": "   I am an assistant   "},
        {"role": "user", "content": "Another question"},
    ],
    "no_system": [
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hi there"},
        {"role": "user", "content": "Who are you"},
    ],
    "padded": [
        {"role": "system", "content": "\n  Be brief.  \n"},
        {"role": "user", "content": "  What is 2+2?\n"},
        {"role": "assistant", "content": " 4 "},
        {"role": "user", "content": "And 3+3? "},
    ],
}

APPLY_CPP = r"""
// usage: lc_chat CONVFILE  (CONVFILE: role \0 content \0 ...); writes, per built-in name and
// add_ass 0/1: name \0 add_ass \0 rendered-or-"!error" \0
#include "llama.h"
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

int main(int argc, char ** argv) {
    if (argc < 2) { fprintf(stderr, "usage: lc_chat CONVFILE\n"); return 1; }
    std::ifstream in(argv[1], std::ios::binary);
    std::stringstream ss; ss << in.rdbuf();
    std::string data = ss.str();
    std::vector<std::string> parts;
    size_t start = 0;
    for (size_t i = 0; i < data.size(); i++) {
        if (data[i] == '\0') { parts.push_back(data.substr(start, i - start)); start = i + 1; }
    }
    std::vector<llama_chat_message> chat;
    for (size_t i = 0; i + 1 < parts.size(); i += 2) {
        chat.push_back({parts[i].c_str(), parts[i + 1].c_str()});
    }
    int32_t n = llama_chat_builtin_templates(nullptr, 0);
    std::vector<const char *> names(n);
    llama_chat_builtin_templates(names.data(), names.size());
    for (const char * name : names) {
        for (int add_ass = 0; add_ass < 2; add_ass++) {
            int32_t len = llama_chat_apply_template(name, chat.data(), chat.size(), add_ass, nullptr, 0);
            std::string out = "!error";
            if (len >= 0) {
                std::vector<char> buf(len + 1);
                llama_chat_apply_template(name, chat.data(), chat.size(), add_ass, buf.data(), buf.size());
                out.assign(buf.data(), len);
            }
            fwrite(name, 1, strlen(name) + 1, stdout);
            fputc(add_ass ? '1' : '0', stdout); fputc('\0', stdout);
            fwrite(out.data(), 1, out.size(), stdout); fputc('\0', stdout);
        }
    }
    return 0;
}
"""


def build_tool(llama_cpp: Path, work: Path) -> Path:
    src, exe = work / "lc_chat.cpp", work / "lc_chat"
    src.write_text(APPLY_CPP.replace("#include <cstdio>", "#include <cstdio>\n#include <cstring>"))
    lib = llama_cpp / "build" / "bin"
    subprocess.run(["g++", "-O1", "-std=c++17", "-I", str(llama_cpp / "include"), "-I",
                    str(llama_cpp / "ggml" / "include"), str(src), "-o", str(exe), "-L", str(lib),
                    "-lllama", "-lggml", "-lggml-base", f"-Wl,-rpath,{lib}"], check=True)
    return exe


def render_all(exe: Path, messages: list[dict[str, str]], work: Path) -> dict[str, dict[str, str]]:
    conv = work / "conv.bin"
    conv.write_bytes(b"".join(f"{m['role']}\0{m['content']}\0".encode() for m in messages))
    raw = subprocess.run([str(exe), str(conv)], check=True, capture_output=True).stdout
    fields = raw.decode("utf-8").split("\0")[:-1]
    out: dict[str, dict[str, str]] = {}
    for i in range(0, len(fields), 3):
        name, add_ass, text = fields[i:i + 3]
        out.setdefault(name, {})["add_generation_prompt" if add_ass == "1" else "no_generation_prompt"] = text
    return out


def llama_cpp_version(llama_cpp: Path) -> str:
    for candidate in (llama_cpp.parent.parent / "PKG-INFO",):
        if candidate.exists():
            for line in candidate.read_text().splitlines():
                if line.startswith("Version:"):
                    return "llama-cpp-python " + line.split(":", 1)[1].strip() + " (vendored llama.cpp)"
    return str(llama_cpp)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama-cpp", type=Path, required=True, help="llama.cpp source tree with build/bin")
    ap.add_argument("--out", type=Path, default=Path("tests/data/chat_templates_reference.json"))
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        exe = build_tool(args.llama_cpp, work)
        renders = {name: render_all(exe, msgs, work) for name, msgs in CONVERSATIONS.items()}
    names = sorted(next(iter(renders.values())))
    doc = {
        "source": f"llama_chat_apply_template of {llama_cpp_version(args.llama_cpp)}, "
                  "by scripts/make_chat_template_reference.py",
        "conversations": CONVERSATIONS,
        "templates": {n: {c: renders[c][n] for c in CONVERSATIONS} for n in names},
    }
    args.out.write_text(json.dumps(doc, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    print(f"{len(names)} templates -> {args.out}")


if __name__ == "__main__":
    main()
