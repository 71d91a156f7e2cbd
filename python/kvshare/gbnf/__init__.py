"""GBNF, llama.cpp's grammar format (the `grammar` field of llama-server requests), converted to
llguidance's Lark-like syntax (`kvshare.constrain.compile_grammar(vocab, "lark", ...)`).

    gbnf_to_lark(text, token_id=None) -> str      # raises GBNFError, a ValueError

Syntax: all of llama.cpp's (its grammars/README.md; its parser, src/llama-grammar.cpp, is the
reference for the details): rules `name ::= ...` (names of letters, digits and `-`, any case;
`root` is where matching starts), alternatives `|`, groups `( )`, `*` `+` `?` `{m}` `{m,}`
`{m,n}`, string literals and character classes `[a-z]` `[^...]` with the escapes
`\\n \\r \\t \\\\ \\" \\[ \\] \\- \\xHH \\uHHHH \\UHHHHHHHH`, `.` (any character, a
newline too), `#` comments, rules over several lines (inside parentheses, and after a `|`
ending a line), tokens `<[id]>` (that token), `!<[id]>` (any one token but that one),
`<text>` (the token whose text that is) and `!<text>`. A later definition of a rule replaces
an earlier one, and repetition bounds go as in llama.cpp: a count above 2000 is an error, a
maximum above 2000 is no maximum, nested repetitions multiplying past 2000 are an error.

Stricter than llama.cpp (errors, with line and column): an undefined rule even if unused, no
`root`, an empty class `[]` / `[^]` (llama.cpp reads them as nothing at all), a reversed
range `[z-a]` (matches nothing there), a surrogate or out-of-range code point in a literal
(can never match), `{m,n}` with n < m, groups nested deeper than 256. Looser: left recursion
(refused by llama.cpp, fine for llguidance's Earley parser).

Tokens: `<[id]>` and `!<[id]>` become llguidance's `<[id]>` and `<[^id]>`. `<text>` needs
`token_id` (text -> id or None, e.g. `Tokenizer.token_to_id`) to mean any token as in
llama.cpp; without it `<text>` is left to llguidance, which knows special (control) tokens by
name only, and `!<text>` is an error.

Why the output is not a rule-for-rule transcription: GBNF matches character by character with
every alternative alive, while llguidance cuts the text into lexemes (string literals,
regexes, terminals) greedily, over all the lexemes its parser allows at that point, without
backtracking: with `start: NAME "s"` and `NAME: /[a-z]+/`, "cats" is read as NAME = "cats" and
the "s" never comes. One-character lexemes are exact (none can run past another: that form is
what the tests compare with), but the parser then steps once per character, with ~100x
slower token masks on a 262K vocabulary for JSON strings. So the converter makes lexemes as
long as it safely can: regular (non-recursive, token-free) rules become Lark terminals (the
idea comes from llguidance's python/llguidance/gbnf_to_lark.py, MIT licensed; this code is
our own), regular sub-expressions single lexemes; then each lexeme that could continue past
the end of a match of some lexeme with a character that may follow that match in the grammar
is split (checked on automata of the two, at the level of UTF-8 lead bytes, since the lexer
reads bytes; any two lexemes are assumed to be allowed at the same time), again until none
can. A split cuts a sequence where the conflict was, else peels its optional tail (`STRING
ws` -> `STRING`, `ws`); alternatives, repetitions and literals split into their parts. The
check has a budget: past it, lexemes are split without checking (slower masks, same
language). A 25 KB JSON-schema-like grammar takes ~1 s, 130 KB ~8 s, 230 KB ~12 s (budget
spent); without `token_id` the last 32 results are cached. Parentheses nested deeper than
llguidance's parser allows (30) go into rules or terminals of their own. llguidance compiles
rules depth-first, recursing at each first use (a chain of ~600 rules overflows a 2 MiB
stack): deep chains are compiled bottom-up through a first alternative of `start` that
matches nothing and uses every definition in dependency order, and a grammar still too deep
is refused.

Modules, each using only those listed before it: `errors` (GBNFError), `charset` (character
sets, UTF-8 lead-byte masks), `tree` (the syntax tree), `parse` (GBNF text to trees),
`analysis` (regular rules; nullable, first, last and follow sets), `earley` (the parser
items predicted at a position, checked against llguidance's row limit), `lark` (Lark names and
text), `automata` (lexeme automata, the exact conflict search), `lexemes` (which nodes are
lexemes, how banned ones split), `conflicts` (the fusion check), `emit` (the output and its
compile-depth guard), `convert` (the passes in order; `gbnf_to_lark`).
"""

from kvshare.gbnf.convert import gbnf_to_lark
from kvshare.gbnf.errors import GBNFError
from kvshare.gbnf.parse import MAX_REPETITION

__all__ = ["GBNFError", "gbnf_to_lark", "MAX_REPETITION"]
