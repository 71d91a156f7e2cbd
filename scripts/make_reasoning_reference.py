#!/usr/bin/env python3
"""llama-server's renderings of thinking models' chat templates with `enable_thinking` on and
off, and its split of a reply into `reasoning_content` and `content`, for the test that checks
kvshare's (`tests/data/reasoning_reference.json`).

    python scripts/make_reasoning_reference.py --llama-cpp PATH/TO/llama.cpp \\
        --out tests/data/reasoning_reference.json

llama.cpp side: a small tool (`APPLY_CPP`) compiled with g++ against a llama.cpp build's
shared libraries including `llama-common` (`cmake -B build -DBUILD_SHARED_LIBS=ON
-DLLAMA_CURL=OFF && cmake --build build --target llama-common`). For each template file it
calls what llama-server calls: `common_chat_templates_init` (with the model's BOS / EOS text),
`common_chat_templates_apply` (Jinja, the conversation below, `add_generation_prompt`,
`enable_thinking`, reasoning_format deepseek) and `common_chat_parse` of a reply with the
parser that rendering produced.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
from pathlib import Path

# file in tests/data/templates, BOS text, EOS text. thinking/ holds the models' templates as
# llama.cpp's models/templates/ keeps them (Hugging Face tokenizer_config.json): every one of
# them that reads enable_thinking. Templates under --templates that read enable_thinking and
# are not listed here are rendered too, with no BOS / EOS text.
TEMPLATES = {
    "Qwen-Qwen3-0.6B.jinja": ("", "<|im_end|>"),
    "thinking/Qwen-QwQ-32B.jinja": ("", "<|im_end|>"),
    "thinking/deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja": ("<｜begin▁of▁sentence｜>",
                                                                "<｜end▁of▁sentence｜>"),
}
CONVERSATION = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "And 3+3?"},
]
# the reply as the model writes it, after the rendered prompt
REPLIES = {
    "thinking": "<think>\nThree plus three is six.\n</think>\n\nIt is 6.",
    "opened": "Three plus three is six.\n</think>\n\nIt is 6.",  # the prompt opened <think>
    "plain": "It is 6.",
}

APPLY_CPP = r"""
// usage: lc_reason TEMPLATE BOS EOS CONVFILE REPLYFILE...: per mode (off, on, auto) writes
// mode \0 supports_thinking \0 enable_thinking \0 prompt \0 then per reply: reasoning \0
// content \0. off / on: what --reasoning off / on give (chat_template_kwargs enable_thinking
// false / true); auto: llama-server's default, enable_thinking = whether the template
// supports thinking (server_context: common_chat_templates_support_enable_thinking)
#include "chat.h"
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

static std::string slurp(const char * path) {
    std::ifstream in(path, std::ios::binary);
    std::stringstream ss; ss << in.rdbuf();
    return ss.str();
}

static void put(const std::string & s) { fwrite(s.data(), 1, s.size(), stdout); fputc('\0', stdout); }

int main(int argc, char ** argv) {
    if (argc < 5) { fprintf(stderr, "usage: lc_reason TEMPLATE BOS EOS CONV REPLY...\n"); return 1; }
    std::string conv = slurp(argv[4]);
    std::vector<std::string> parts;
    size_t start = 0;
    for (size_t i = 0; i < conv.size(); i++) {
        if (conv[i] == '\0') { parts.push_back(conv.substr(start, i - start)); start = i + 1; }
    }
    auto tmpls = common_chat_templates_init(nullptr, slurp(argv[1]), argv[2], argv[3]);
    const char * modes[] = {"off", "on", "auto"};
    for (int mode = 0; mode < 3; mode++) {
        const bool think = mode == 2 ? common_chat_templates_support_enable_thinking(tmpls.get())
                                     : mode == 1;
        common_chat_templates_inputs inputs;
        for (size_t i = 0; i + 1 < parts.size(); i += 2) {
            common_chat_msg m;
            m.role = parts[i];
            m.content = parts[i + 1];
            inputs.messages.push_back(m);
        }
        inputs.add_generation_prompt = true;
        inputs.enable_thinking = think;
        if (mode < 2) {
            inputs.chat_template_kwargs["enable_thinking"] = think ? "true" : "false";
        }
        inputs.reasoning_format = COMMON_REASONING_FORMAT_DEEPSEEK;
        auto params = common_chat_templates_apply(tmpls.get(), inputs);
        put(modes[mode]);
        put(params.supports_thinking ? "1" : "0");
        put(think ? "1" : "0");
        put(params.prompt);
        common_chat_parser_params pp(params);
        pp.reasoning_format = COMMON_REASONING_FORMAT_DEEPSEEK;
        pp.parser.load(params.parser);
        for (int r = 5; r < argc; r++) {
            try {
                auto msg = common_chat_parse(slurp(argv[r]), false, pp);
                put(msg.reasoning_content);
                put(msg.content);
            } catch (const std::exception &) {  // a reply this template's parser refuses
                put("\x01");
                put("\x01");
            }
        }
    }
    return 0;
}
"""


def build_tool(llama_cpp: Path, work: Path) -> Path:
    src, exe = work / "lc_reason.cpp", work / "lc_reason"
    src.write_text(APPLY_CPP)
    lib = llama_cpp / "build" / "bin"
    incs = [llama_cpp / "include", llama_cpp / "ggml" / "include", llama_cpp / "common",
            llama_cpp / "vendor"]
    subprocess.run(["g++", "-O1", "-std=c++17", *[f"-I{p}" for p in incs], str(src), "-o",
                    str(exe), "-L", str(lib), "-lllama-common", "-lllama", "-lggml",
                    "-lggml-base", f"-Wl,-rpath,{lib}"], check=True)
    return exe


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama-cpp", type=Path, required=True,
                    help="llama.cpp source tree with build/bin")
    ap.add_argument("--templates", type=Path, default=Path("tests/data/templates"))
    ap.add_argument("--out", type=Path, default=Path("tests/data/reasoning_reference.json"))
    args = ap.parse_args()
    cases: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        exe = build_tool(args.llama_cpp, work)
        conv = work / "conv.bin"
        conv.write_bytes(b"".join(f"{m['role']}\0{m['content']}\0".encode() for m in CONVERSATION))
        reply_files = []
        for name, text in REPLIES.items():
            (work / name).write_text(text, encoding="utf-8")
            reply_files.append(str(work / name))
        found = sorted(str(f.relative_to(args.templates)) for f in args.templates.rglob("*.jinja")
                       if "enable_thinking" in f.read_text(encoding="utf-8"))
        for file, (bos, eos) in {**TEMPLATES, **{f: ("", "") for f in found
                                                 if f not in TEMPLATES}}.items():
            raw = subprocess.run([str(exe), str(args.templates / file), bos, eos, str(conv),
                                  *reply_files], check=True, capture_output=True).stdout
            fields = raw.decode("utf-8").split("\0")[:-1]
            per = 4 + 2 * len(REPLIES)
            out = {}
            for i in range(0, len(fields), per):
                mode, supports, think, prompt, *rest = fields[i:i + per]
                out[mode] = {
                    "supports_thinking": supports == "1", "enable_thinking": think == "1",
                    "prompt": prompt,
                    "parsed": {name: {"reasoning_content": rest[2 * j], "content": rest[2 * j + 1]}
                               for j, name in enumerate(REPLIES) if rest[2 * j] != "\x01"}}
            cases[file] = {"bos_token": bos, "eos_token": eos, "enable_thinking": out}
    doc = {"source": "common_chat_templates_apply / common_chat_parse of llama-cpp-python "
                     "0.3.36's vendored llama.cpp, by scripts/make_reasoning_reference.py",
           "conversation": CONVERSATION, "replies": REPLIES, "templates": cases}
    args.out.write_text(json.dumps(doc, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    print(f"{len(cases)} templates -> {args.out}")


if __name__ == "__main__":
    main()
