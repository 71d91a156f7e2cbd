"""kvshare.gbnf: llama.cpp's GBNF grammars converted to llguidance Lark and compiled over
tiny-qwen3-chat's real tokenizer. llama.cpp's own grammars (tests/data/gbnf, MIT) accept
valid text and reject invalid text; syntax errors name line and column; edge cases of the
syntax; the fusion of characters into lexemes never changes what is accepted: grammars that
trip llguidance's greedy lexer when transcribed naively, and random grammars checked against
the one-character-lexeme conversion (exact by construction)."""

from __future__ import annotations

import random
import re
import threading
from pathlib import Path

import numpy as np
import pytest

from kvshare.constrain import GrammarError, TokenVocab, apply_mask, compile_grammar
from kvshare.gbnf import GBNFError, automata, gbnf_to_lark, tree
from kvshare.gbnf.convert import convert
from kvshare.gbnf.parse import Parser
from kvshare.model.tokenizer import Tokenizer

DATA = Path(__file__).parent / "data"
GBNF = DATA / "gbnf"


class Qwen:
    def __init__(self):
        self.tok = Tokenizer.from_gguf(DATA / "models" / "tiny-qwen3-chat.gguf")
        self.eos = self.tok.eos_id
        self.vocab = TokenVocab.from_tokenizer(self.tok, vocab_size=len(self.tok),
                                               eos_id=self.eos)

    def compile(self, gbnf: str, fuse: bool = True, **kw):
        lark = gbnf_to_lark(gbnf, **kw) if fuse else convert(gbnf, None, fuse=False)
        return compile_grammar(self.vocab, "lark", lark)

    def accepts(self, grammar, text: str) -> bool:
        """The tokens of `text` consumed one by one, and the grammar complete after them."""
        m = grammar.matcher()
        try:
            for t in self.tok.encode(text, add_special=False):
                m.consume(t)
        except GrammarError:
            return False
        return m.accepting

    def sample(self, grammar, rng: np.random.Generator, max_tokens: int = 40) -> str | None:
        """A random text the grammar allows (random logits, masked), or None."""
        m = grammar.matcher()
        mask = np.empty(self.vocab.mask_words, np.uint32)
        ids: list[int] = []
        for _ in range(max_tokens):
            try:
                m.fill_mask(mask)
            except GrammarError:
                return None
            logits = rng.standard_normal(len(self.tok)).astype(np.float32)
            logits[self.eos] += rng.uniform(-2, 3)
            t = int(np.argmax(apply_mask(logits, mask)))
            if t == self.eos:
                return self.tok.concat_pieces(ids).decode("utf-8", "replace")
            m.consume(t)
            ids.append(t)
        return None


@pytest.fixture(scope="module")
def qwen() -> Qwen:
    return Qwen()


def check(qwen: Qwen, gbnf: str, valid: list[str], invalid: list[str], **kw) -> None:
    """Both conversions (fused lexemes and one-character lexemes) accept exactly `valid`."""
    for fuse in (True, False):
        g = qwen.compile(gbnf, fuse, **kw) if fuse else qwen.compile(gbnf, fuse)
        for s in valid:
            assert qwen.accepts(g, s), (fuse, s)
        for s in invalid:
            assert not qwen.accepts(g, s), (fuse, s)


# --- llama.cpp's grammars ----------------------------------------------------------------------

GRAMMARS = {
    "json.gbnf": (
        ['{}', '{"a": 1}', '{"a":[1, 2.5, -3, true, null, "x\\n"]}', '{\n  "k": {"n": {}}\n}',
         '{"é": "日本語"}', '{"a": "\\u00e9\\"q"}', '{ "a": 1}', '{"a": 1e19}'],
        # json.gbnf's quirks are kept: one space or a newline and 20 tabs/spaces at most, and
        # an exponent [0-9] [1-9]{0,15} (so 1e10 is out)
        ['[]', '{"a" 1}', '{"a": 01}', "{'a': 1}", '{"a": tru}', '{  "a": 1}', '{"a": 1e10}',
         '{"a": "x\ny"}', '{"a": 1}}', '{"a": 1,}'],
    ),
    "json_arr.gbnf": (
        ['[\n]', '[\n1,\n2]', '[\n{"a": 1},\n "x"]', '[\n [1, {"b": null}]]'],
        ['[]', '[\n1, 2]', '[\n1]\n', '[\n1,\n  "x"]', '{"a": 1}'],
    ),
    "arithmetic.gbnf": (
        # "x=y\n": the identifier's whitespace [ \t\n]* must not eat the line's "\n"
        ['x=y\n', 'a +b = c\n', 'x = (a +b1*22)\ny =7\n', 'x=y\n\n', '(a)=1\n'],
        ['x=y', '=y\n', 'x==y\n', 'X=y\n', 'a + b = c\n'],
    ),
    "list.gbnf": (
        ['- a\n', '- milk\n- eggs and ham\n', '- 日本\n'],
        ['-a\n', '- \n', '- a', '- a\u2028b\n', ''],
    ),
    "chess.gbnf": (
        ['1. e4 e5\n2. Nf3 Nc6\n', '1. d4 d5\n2. c4 dxc4\n10. Qa4+ Bd7\n',
         '1. e4 e5\n2. O-O O-O-O\n'],
        ['1. e4 e5\n', '1. e9 e5\n2. a3 a6\n', '1. e4 e5\n0. a3 a6\n', '1. e4  e5\n2. a3 a6\n'],
    ),
    "japanese.gbnf": (
        ['こんにちは', '日本語 テスト', 'カタカナ、ひらがな\n漢字'],
        ['abc', '日本 ', '日本  語', ''],
    ),
    "english.gbnf": (
        ['Hello, world!', 'a b\tc\nd', '[x] {y} |z| \\w'],
        ['Hello  world', 'héllo', ' lead', ''],
    ),
    "c.gbnf": (
        # keywords are identifiers too: `while = 5;` assigns to one
        ['int main(){return 0;}', 'int f(int x){x = x+1;return x;}',
         'int main(){int x = 5;while(x<10){x = x+1;}return x;}',
         'int f(){while = 5;}', 'int f(){return = 5;}', 'char g(){// note\nreturn 1;}',
         'float h(){/* a * b */if(a==b){}else{}}'],
        ['int main(){return 0}', 'int main(){x=1;}', 'void main(){}', 'int main() {}',
         'int f(){/* open}'],
    ),
}


@pytest.mark.parametrize("name", sorted(GRAMMARS))
def test_llama_cpp_grammars(qwen, name):
    text = (GBNF / name).read_text()
    valid, invalid = GRAMMARS[name]
    check(qwen, text, valid, invalid)


def test_long_runs_become_single_lexemes():
    """JSON strings, numbers and whitespace are terminals (one lexeme each), not rules
    stepping character by character: masks ~200x faster on a large vocabulary."""
    out = gbnf_to_lark((GBNF / "json.gbnf").read_text())
    terms = dict(re.findall(r"^([A-Z][A-Z0-9_-]*): (.*)$", out, re.M))
    assert {"STRING", "NUMBER", "WS"} <= set(terms)
    assert "STRING" in out.split("\nSTRING:")[0]  # used by the rules


# --- syntax errors --------------------------------------------------------------------------

ERRORS = [
    ('root ::= "a', 1, 10, "unterminated string"),
    ('root ::= [a-', 1, 10, "unterminated character class"),
    ('root ::= "a" )', 1, 14, "unmatched ')'"),
    ('root ::= ("a"', 1, 14, "expected ')'"),
    ('root ::= ("a"\n\n  "b" ]', 3, 7, "expected ')'"),
    ('root = "a"', 1, 6, "expected '::='"),
    ('root ::= "\\q"', 1, 11, "unknown escape"),
    ('root ::= "\\x4"', 1, 11, "2 hexadecimal digits"),
    ('root ::= [\\u12]', 1, 11, "4 hexadecimal digits"),
    ('root ::= * "a"', 1, 10, "expected an item before '*'"),
    ('root ::= "a" | +', 1, 16, "expected an item before '+'"),
    ('root ::= "a"{2,1}', 1, 13, "maximum below its minimum"),
    ('root ::= "a"{x}', 1, 14, "expected a number"),
    ('root ::= "a"{2', 1, 15, "expected ',' or '}'"),
    ('root ::= "a"{2,3', 1, 17, "expected '}'"),
    ('root ::= "a"{2001}', 1, 13, "more than 2000"),
    ('root ::= ("a"{100}){100}', 1, 20, "multiply to more than 2000"),
    ('root ::= "a"\nx ::= foo', 2, 7, "undefined rule 'foo'"),
    ('x ::= "a"\n', 2, 1, "no 'root' rule"),
    ('', 1, 1, "no 'root' rule"),
    ('root ::= "a"\n  | "b"', 2, 3, "expected a rule name"),
    ('root ::= [z-a]', 1, 11, "reversed"),
    ('root ::= []', 1, 10, "empty character class"),
    ('root ::= [^]', 1, 10, "empty character class"),
    ('root ::= "\\uD800"', 1, 11, "surrogate"),
    ('root ::= "\\U00110000"', 1, 11, "beyond"),
    ('root ::= <[abc]>', 1, 12, "expected a token id"),
    ('root ::= <[12>', 1, 14, "expected ']>'"),
    ('root ::= <foo', 1, 10, "unterminated token"),
    ('root ::= !<foo>', 1, 10, "needs the model's vocabulary"),
    ('root ::= !"a"', 1, 11, "expected '<'"),
    ('root ::= <a b>', 1, 10, "cannot be named in Lark"),
    ('root ::= "a" ; "b"', 1, 14, "expected an item, '|', or the end of the rule"),
    ('root ::= "a"\n\nfoo bar ::= "b"', 3, 5, "expected '::='"),
    ("root ::= " + "(" * 300 + '"a"' + ")" * 300, 1, 266, "nested more than 256"),
    ('root ::= "a"****+', 1, 17, None),  # merged into one repetition: fine
]


@pytest.mark.parametrize("text,line,column,message", ERRORS)
def test_syntax_errors(text, line, column, message):
    if message is None:
        gbnf_to_lark(text)
        return
    with pytest.raises(GBNFError) as e:
        gbnf_to_lark(text)
    assert isinstance(e.value, ValueError)
    assert (e.value.line, e.value.column) == (line, column), str(e.value)
    assert message in e.value.message
    assert f"line {line}, column {column}" in str(e.value)


# --- edge cases ----------------------------------------------------------------------------

EDGE = [
    # escapes in literals and classes
    ('root ::= "\\x41\\u00e9\\U0001F600\\n\\t\\r\\\\\\"\\[\\]\\-"',
     ['Aé😀\n\t\r\\"[]-'], ['Aé😀']),
    ('root ::= [\\]\\[\\-\\\\^a]+', [']-[\\^a'], ['b', '']),
    ('root ::= [^\\n"]+ "\\n"', ['é x\n'], ['a"b\n', '\n']),
    ('root ::= [a-] [-a] "x"', ['--x', 'aax'], ['bax']),
    # raw characters, including a newline, inside a literal
    ('root ::= "a\nb" "日本"', ['a\nb日本'], ['ab日本']),
    # `.` is any character, a newline too
    ('root ::= "a" . "b"', ['a\nb', 'aéb', 'a😀b'], ['ab', 'a\n\nb']),
    # empty alternatives and empty literals
    ('root ::= | "a"', ['', 'a'], ['aa']),
    ('root ::= "a" (| "b" |) "c" ""', ['ac', 'abc'], ['abbc']),
    ('root ::= ()', [''], ['a']),
    # nested groups
    ('root ::= ((("a" | "b") "c")+ | "d"){2}', ['acbc', 'dd', 'acd', 'dbcac'], ['ac', 'ddd']),
    # repetition bounds
    ('root ::= "a"{3}', ['aaa'], ['aa', 'aaaa']),
    ('root ::= "a"{2,}', ['aa', 'aaaaaaa'], ['a']),
    ('root ::= "a"{0,2} "b"', ['b', 'ab', 'aab'], ['aaab']),
    ('root ::= ("ab"){1,3}', ['ab', 'ababab'], ['', 'abababab', 'aba']),
    ('root ::= "a"{ 2 , 3 }', ['aa', 'aaa'], ['a']),
    ('root ::= "a"{0} "b"', ['b'], ['ab']),
    ('root ::= "a"{1,5000}', ['a' * 50], ['']),  # a maximum above 2000: none, as llama.cpp
    ('root ::= ("a"+)? "b"', ['b', 'aab'], ['a']),
    ('root ::= "a"*?+ "b"', ['b', 'aab'], ['a']),
    ('root ::= ("a"{2}){3}', ['a' * 6], ['a' * 4]),
    ('root ::= ("a"{1,2}){2}', ['aa', 'aaa', 'aaaa'], ['a', 'aaaaa']),
    # comments, rules over several lines (after '|', inside parentheses)
    ('# top\nroot ::= "a" |  # alt\n  "b" (\n  "c" # in a group\n\n  | "d"\n)\n# end\n',
     ['a', 'bc', 'bd'], ['b']),
    ('root ::=\n  "a"\n', ['a'], ['']),
    ('root ::= x\r\nx ::= "a"\r\n', ['a'], []),
    # names: '-', digits first, upper case (not Lark terminals), Lark's own words
    ('root ::= Foo-Bar x1 2x WS ws\nFoo-Bar ::= "f"\nx1 ::= "1"\n2x ::= "2"\nWS ::= "y"\n'
     'ws ::= "w"', ['f12yw'], ['f12wy']),
    ('root ::= if json regex lark ignore import\nif ::= "i"\njson ::= "j"\nregex ::= "r"\n'
     'lark ::= "l"\nignore ::= "g"\nimport ::= "m"', ['ijrlgm'], []),
    # a rule named start; root used recursively
    ('root ::= "(" root ")" | start\nstart ::= "s"', ['s', '((s))'], ['(s', 'start']),
    # a later definition replaces an earlier one (as in llama.cpp)
    ('root ::= "a"\nroot ::= "b"', ['b'], ['a']),
    # rules defined but never used, rules used before their definition
    ('root ::= b\nunused ::= "u"\nb ::= "b"', ['b'], ['u']),
    # left recursion (llama.cpp refuses it; llguidance's Earley parser does not mind)
    ('root ::= root "a" | "b"', ['b', 'baaa'], ['a']),
]


@pytest.mark.parametrize("text,valid,invalid", EDGE)
def test_edge_cases(qwen, text, valid, invalid):
    check(qwen, text, valid, invalid)


def test_deep_nesting_is_split_for_llguidance(qwen):
    """llguidance's Lark parser allows 30 levels of parentheses; json-schema-to-grammar's
    maxLength strings nest one group per character."""
    text = 'root ::= "\\"" char' + " (char" * 60 + ")?" * 60 + ' "\\""\nchar ::= [a-z]'
    out = gbnf_to_lark(text)
    assert max(len(m) for m in re.findall(r"\(+", out)) <= 16
    check(qwen, text, ['"' + "x" * n + '"' for n in (1, 30, 61)], ['""', '"' + "x" * 62 + '"'])


def test_deep_rule_chains_compile_on_a_small_stack(qwen):
    """llguidance compiles rules recursively at their first use: a chain of ~600 overflows a
    2 MiB thread stack (a crash). Chains are compiled bottom-up instead; a cycle that deep
    is refused."""
    chain = 'root ::= r0 ("(" root ")")?\n' + "".join(
        f'r{i} ::= "x" r{i + 1} | "y"\n' for i in range(800)) + 'r800 ::= "z"\n'
    out = gbnf_to_lark(chain)
    result = {}

    def run():
        g = compile_grammar(qwen.vocab, "lark", out)
        result["ok"] = [qwen.accepts(g, s) for s in ("y", "xxxy", "y(xy)", "x" * 800 + "z", "x")]

    threading.stack_size(2 << 20)
    try:
        t = threading.Thread(target=run)
        t.start()
        t.join()
    finally:
        threading.stack_size(0)
    assert result["ok"] == [True, True, True, True, False]
    cycle = "root ::= r0\n" + "".join(f'r{i} ::= "x" r{i + 1} | "y"\n' for i in range(800))
    with pytest.raises(GBNFError, match="levels deep"):
        gbnf_to_lark(cycle + 'r800 ::= "z" r0\n')


def test_tokens(qwen):
    tok = qwen.tok
    start = tok.token_to_id("<|im_start|>")
    a = tok.encode("a", add_special=False)
    assert len(a) == 1

    def run(grammar, ids):
        m = grammar.matcher()
        try:
            for t in ids:
                m.consume(t)
        except GrammarError:
            return False
        return m.accepting

    for text in [f'root ::= <[{start}]> "a"', 'root ::= <|im_start|> "a"']:
        g = qwen.compile(text)
        assert run(g, [start] + a)
        assert not run(g, a)
    g = qwen.compile(f'root ::= !<[{start}]> "a"')
    assert run(g, a + a)
    assert not run(g, [start] + a)
    # by text with the vocabulary: any token, as llama.cpp; negated too
    g = qwen.compile('root ::= !<|im_start|> "a"', token_id=tok.token_to_id)
    assert run(g, a + a) and not run(g, [start] + a)
    with pytest.raises(GBNFError, match="not a token"):
        gbnf_to_lark('root ::= <nope>', token_id=tok.token_to_id)


def test_output_shape():
    """One `start:` line first (kvshare.toolcalls.allow_reasoning renames it), no name that
    could meet the reasoning wrapper's `kvshare_*` ones."""
    text = ('root ::= kvshare-think KVSHARE start root2\nkvshare-think ::= "k"\nKVSHARE ::= "K"\n'
            'start ::= "s"\nroot2 ::= "r" | "(" root ")"')
    out = gbnf_to_lark(text)
    lines = out.splitlines()
    assert lines[0].startswith("start: ")
    assert sum(line.startswith("start:") for line in lines) == 1
    names = re.findall(r"^([A-Za-z_][A-Za-z0-9_-]*):", out, re.M)
    assert not [n for n in names if n.lower().startswith("kvshare")]


def test_reasoning_wrapper_compiles(qwen):
    from kvshare.toolcalls import allow_reasoning

    lark = allow_reasoning(gbnf_to_lark((GBNF / "json.gbnf").read_text()))
    g = compile_grammar(qwen.vocab, "lark", lark)
    assert qwen.accepts(g, '<think>\nhmm {"a": 1}\n</think>\n\n{"a": 1}')
    assert qwen.accepts(g, '{"a": 1}')


# --- fusion never changes the language -----------------------------------------------------

R = '("(" root ")")?'  # a recursive tail: a regular grammar would be one exact terminal
GREEDY = [
    # a terminal /[a-z]+/ followed by "s": llguidance would read "cats" whole
    (f'root ::= word "s" {R}\nword ::= [a-z]+', ['cats', 'ss', 'cats(ss)'], ['cat']),
    (f'root ::= ("a" | "ab") "bc" {R}', ['abc', 'abbc', 'abc(abbc)'], ['ac']),
    (f'root ::= [0-9]+ [0-9] {R}', ['12', '123', '12(123)'], ['1']),
    (f'root ::= x "\n" {R}\nx ::= [a-z]+ ws\nws ::= [ \n]*', ['ab\n', 'ab \n\n', 'a\n(b\n)'],
     ['ab']),
    # the lexer reads bytes: é and è share their first byte
    (f'root ::= ("a" | "aé") "è" {R}', ['aè', 'aéè', 'aè(aéè)'], ['aé']),
    (f'root ::= (" " | " bb"){{1,3}} ("bba" [cè])* {R}', [' bb', ' bbbbac', '   ', ' ( bb)'],
     ['b']),
]


@pytest.mark.parametrize("text,valid,invalid", GREEDY)
def test_greedy_lexing_traps(qwen, text, valid, invalid):
    check(qwen, text, valid, invalid)


ALPHABET = ["a", "b", "c", "é", "è", " "]


def random_grammar(rng: random.Random) -> str:
    """Up to 5 rules over a small alphabet (é and è share a UTF-8 lead byte): literals,
    classes, groups, repetitions, references to later rules, rare guarded recursion."""
    names = ["root"] + [f"r{i}" for i in range(1, rng.randint(1, 5))]

    def atom() -> str:
        r = rng.random()
        if r < 0.45:
            return '"' + "".join(rng.choice(ALPHABET) for _ in range(rng.randint(1, 3))) + '"'
        if r < 0.9:
            chars = "".join(rng.sample(ALPHABET, rng.randint(1, 3)))
            return "[" + ("^" if rng.random() < 0.1 else "") + chars + "]"
        return '""'

    def expr(depth: int, me: int) -> str:
        k = rng.random()
        if depth > 2 or k < 0.3:
            if rng.random() < 0.3 and me + 1 < len(names):
                return names[rng.randrange(me + 1, len(names))]
            if rng.random() < 0.05:
                return '"(" ' + names[rng.randrange(0, me + 1)] + ' ")"'
            return atom()
        if k < 0.6:
            return " ".join(expr(depth + 1, me) for _ in range(rng.randint(2, 3)))
        if k < 0.75:
            return "(" + " | ".join(expr(depth + 1, me) for _ in range(rng.randint(2, 3))) + ")"
        op = rng.choice(["*", "+", "?", "{2}", "{0,2}", "{1,}", "{1,3}"])
        return "(" + expr(depth + 1, me) + ")" + op

    return "\n".join(f"{n} ::= {expr(0, i)}" for i, n in enumerate(names)) + "\n"


@pytest.mark.parametrize("limit", ["CHECK_BUDGET", "BUILD_BUDGET", "MAX_NFA_STATES"])
def test_out_of_budget_only_splits_more(qwen, monkeypatch, limit):
    """Past the check's budgets, or for lexemes too big to check, lexemes are split unchecked:
    same language."""
    monkeypatch.setattr(automata, limit, 6 if limit == "MAX_NFA_STATES" else 0)
    for name in ("arithmetic.gbnf", "c.gbnf", "json.gbnf"):
        text = (GBNF / name).read_text()
        g = compile_grammar(qwen.vocab, "lark", convert(text, None, fuse=True))
        valid, invalid = GRAMMARS[name]
        assert all(qwen.accepts(g, s) for s in valid)
        assert not any(qwen.accepts(g, s) for s in invalid)


def reference_match(text: str, s: str) -> bool:
    """Whether the GBNF grammar `text` matches `s`: a memoized search over the syntax tree,
    every alternative kept alive (as llama.cpp); no left recursion."""
    p = Parser(text, None)
    p.parse()
    memo: dict[tuple[int, int], frozenset[int]] = {}

    def ends(node, i: int) -> frozenset[int]:
        key = (id(node), i)
        if key in memo:
            return memo[key]
        out: set[int] = set()
        if isinstance(node, tree.Lit):
            if s.startswith(node.text, i):
                out.add(i + len(node.text))
        elif isinstance(node, tree.Cls):
            if i < len(s) and any(lo <= ord(s[i]) <= hi for lo, hi in node.ranges):
                out.add(i + 1)
        elif isinstance(node, tree.Ref):
            out = set(ends(p.rules[node.name], i))
        elif isinstance(node, tree.Seq):
            cur = {i}
            for it in node.items:
                cur = {k for j in cur for k in ends(it, j)}
            out = cur
        elif isinstance(node, tree.Alt):
            out = {k for a in node.alts for k in ends(a, i)}
        else:
            cur, count = {i}, 0
            if node.lo == 0:
                out |= cur
            while cur and (node.hi is None or count < node.hi):
                cur = {k for j in cur for k in ends(node.item, j)}
                count += 1
                if count >= node.lo:
                    if cur <= out:
                        break
                    out |= cur
        memo[key] = frozenset(out)
        return memo[key]

    return len(s) in ends(p.rules["root"], 0)


@pytest.mark.parametrize("chunk", range(4))
def test_fused_matches_exact_on_random_grammars(qwen, chunk):
    """Texts sampled from the one-character-lexeme conversion (exact: no lexeme can run past
    another), and mutations of them, are accepted by both conversions exactly when the
    grammar matches them."""
    compared = 0
    for seed in range(chunk * 60, chunk * 60 + 60):
        rng = random.Random(seed)
        nrng = np.random.default_rng(seed)
        text = random_grammar(rng)
        exact = qwen.compile(text, fuse=False)
        fused = qwen.compile(text)
        samples = {s for s in (qwen.sample(exact, nrng) for _ in range(6)) if s is not None}
        texts = set(samples)
        for s in samples:
            i = rng.randrange(len(s) + 1)
            texts.add(s[:i] + rng.choice(ALPHABET) + s[i:])
            if s:
                texts.add(s[:i] + s[i + 1:])
        for s in texts:
            want = reference_match(text, s)
            assert want or s not in samples
            assert qwen.accepts(exact, s) == want, (text, s)
            assert qwen.accepts(fused, s) == want, (text, s)
            compared += 1
    assert compared > 300
