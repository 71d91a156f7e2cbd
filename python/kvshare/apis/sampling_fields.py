"""The sampling fields of every API, read from one table.

`FIELDS` lists each `SamplingParams` knob once: its request names, whether it is an integer,
the range the engine accepts and the llama-server sampler that turns it on. An API differs only
in its `SamplingDialect`: which fields it has, its defaults, its own limits (refused with a 400)
and soft limits (clamped, as llama-server clamps), and how it words a bad value.
`parse_sampling` reads a request body through a dialect; the server's own defaults
(`ServerSettings.sampling_defaults`, llama-server's `--temp`, `--top-k`, ...) fill in what a
request leaves out.

Adding a sampling parameter: a field on `engine.api.SamplingParams` and its use in
`engine/sampling.py` (the engine), and one `SamplingField` row here. An API whose dialect lists
its fields (`params`) names it there too if that API has the field.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Collection, Mapping

from kvshare.engine.api import SamplingParams

from . import parsing as P

Number = float | int


@dataclass(frozen=True)
class Range:
    """[lo, hi]; None: unbounded on that side."""

    lo: float | None = None
    hi: float | None = None

    def clamp(self, v: Number) -> Number:
        if self.lo is not None and v < self.lo:
            v = type(v)(self.lo)
        if self.hi is not None and v > self.hi:
            v = type(v)(self.hi)
        return v


@dataclass(frozen=True)
class SamplingField:
    param: str  # the `SamplingParams` attribute
    names: tuple[str, ...]  # request names; the first one present wins
    integer: bool = False
    valid: Range = Range()  # what the engine accepts; outside it a request gets a 400
    sampler: str | None = None  # llama-server `samplers` entry; left out: the field is off


FIELDS: tuple[SamplingField, ...] = (
    SamplingField("temperature", ("temperature",), valid=Range(0.0, 100.0),
                  sampler="temperature"),
    SamplingField("top_k", ("top_k",), integer=True, valid=Range(-1, None), sampler="top_k"),
    SamplingField("top_p", ("top_p",), valid=Range(0.0, 1.0), sampler="top_p"),
    SamplingField("min_p", ("min_p",), valid=Range(0.0, 1.0), sampler="min_p"),
    SamplingField("seed", ("seed",), integer=True, valid=Range(-(2**63), 2**64 - 1)),
    SamplingField("presence_penalty", ("presence_penalty",), valid=Range(-2.0, 2.0),
                  sampler="penalties"),
    SamplingField("frequency_penalty", ("frequency_penalty",), valid=Range(-2.0, 2.0),
                  sampler="penalties"),
    # >= 0.01: a smaller divisor overflows float32 logits (1e-300 made every score infinite);
    # the sampler still fails the one sequence if scores turn non-finite.
    SamplingField("repetition_penalty", ("repeat_penalty", "repetition_penalty"),
                  valid=Range(0.01, 10.0), sampler="penalties"),
    SamplingField("penalty_last_n", ("repeat_last_n", "penalty_last_n"), integer=True,
                  valid=Range(-1, None)),
)
FIELD_BY_PARAM = {f.param: f for f in FIELDS}
_OFF: dict[str, Any] = vars(SamplingParams())  # every knob's off value


class NumberReader:
    """Reads one number of a body with the API's wording of a bad value (a 400)."""

    def number(self, body: dict, name: str, r: Range) -> float | None:
        return P.get_float(body, name, lo=r.lo, hi=r.hi)

    def integer(self, body: dict, name: str, r: Range) -> int | None:
        lo = None if r.lo is None else int(r.lo)
        hi = None if r.hi is None else int(r.hi)
        return P.get_int(body, name, lo=lo, hi=hi)


@dataclass(frozen=True)
class SamplingDialect:
    """How one API spells and bounds the sampling fields."""

    params: frozenset[str] | None = None  # the fields the API has (None: all of FIELDS)
    defaults: Mapping[str, Number] = field(default_factory=dict)  # else SamplingParams's
    valid: Mapping[str, Range] = field(default_factory=dict)  # the API's own limits (400)
    clamp: Mapping[str, Range] = field(default_factory=dict)  # soft limits, clamped into
    names: Mapping[str, tuple[str, ...]] = field(default_factory=dict)  # instead of the field's
    lenient_ints: frozenset[str] = frozenset()  # integers that may come as numbers (truncated)
    reader: NumberReader = field(default_factory=NumberReader)

    def has(self, param: str) -> bool:
        return self.params is None or param in self.params


# OpenAI chat and completions (with llama.cpp's extensions: top_k, min_p, repeat_penalty, ...)
OPENAI = SamplingDialect(clamp={"top_k": Range(0, None)})

# llama-server's `/completion` and `/infill`: common_params_sampling's defaults; temperature,
# top_k, top_p and min_p are clamped into range, the penalties refused outside it.
LLAMA_SERVER = SamplingDialect(
    defaults={"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05},
    valid={"temperature": Range(None, 100.0), "top_k": Range(), "top_p": Range(),
           "min_p": Range()},
    clamp={"temperature": Range(0.0, None), "top_k": Range(0, None),
           "top_p": Range(0.0, 1.0), "min_p": Range(0.0, 1.0)},
    names={"repetition_penalty": ("repeat_penalty",), "penalty_last_n": ("repeat_last_n",)},
    lenient_ints=frozenset({"top_k"}),
)

# The Responses API: temperature 0-2 and top_p.
RESPONSES = SamplingDialect(params=frozenset({"temperature", "top_p"}),
                            valid={"temperature": Range(0.0, 2.0)})


def anthropic_dialect(reader: NumberReader) -> SamplingDialect:
    """Anthropic Messages: temperature 0-1, top_p, top_k >= 0, in its own error wording."""
    return SamplingDialect(params=frozenset({"temperature", "top_p", "top_k"}),
                           valid={"temperature": Range(0.0, 1.0), "top_k": Range(0, None)},
                           reader=reader)


def _read(body: dict, f: SamplingField, d: SamplingDialect) -> Number | None:
    valid = d.valid.get(f.param, f.valid)
    for name in d.names.get(f.param, f.names):
        if body.get(name) is None:
            continue
        if f.integer and f.param in d.lenient_ints:
            v = d.reader.number(body, name, valid)
            return None if v is None else int(v)
        if f.integer:
            return d.reader.integer(body, name, valid)
        return d.reader.number(body, name, valid)
    return None


def _engine_value(param: str, v: Number, ctx_size: int) -> Number | None:
    """A request's value as the engine takes it."""
    if param == "seed":
        return None if v == -1 else int(v) % 2**64  # -1: random; negatives wrap as uint64
    if param == "penalty_last_n" and v == -1:
        return ctx_size  # -1: the whole context
    return v


def parse_sampling(body: dict, dialect: SamplingDialect, *, ctx_size: int,
                   server_defaults: Mapping[str, Number] | None = None,
                   samplers: Collection[str] | None = None,
                   logit_bias: tuple[tuple[int, float], ...] = ()) -> SamplingParams:
    """The request's `SamplingParams`. A field the request leaves out takes the server's
    default, else the API's, else its off value; `samplers` (llama-server) turns off every
    field whose sampler it leaves out."""
    values: dict[str, Any] = {}
    for f in FIELDS:
        v = _read(body, f, dialect) if dialect.has(f.param) else None
        if v is None:
            v = (server_defaults or {}).get(f.param, dialect.defaults.get(f.param))
        if v is None:
            continue
        clamp = dialect.clamp.get(f.param)
        if clamp is not None:
            v = clamp.clamp(v)
        if samplers is not None and f.sampler is not None and f.sampler not in samplers:
            continue  # off
        values[f.param] = _engine_value(f.param, v, ctx_size)
    return SamplingParams(**values, logit_bias=logit_bias)


def check_server_defaults(defaults: Mapping[str, Number]) -> None:
    """Raises ValueError naming the first server default the engine would refuse."""
    for param, v in defaults.items():
        f = FIELD_BY_PARAM.get(param)
        if f is None:
            raise ValueError(f"unknown sampling parameter {param!r}")
        r = f.valid
        if (r.lo is not None and v < r.lo) or (r.hi is not None and v > r.hi):
            raise ValueError(f"{param} must be in [{r.lo}, {r.hi}], got {v}")


def reported_settings(dialect: SamplingDialect,
                      server_defaults: Mapping[str, Number] | None = None) -> dict[str, Number]:
    """The sampling defaults a request without sampling fields gets, by `SamplingParams`
    name (llama-server's `/props` `default_generation_settings`)."""
    out: dict[str, Number] = {}
    for f in FIELDS:
        v = (server_defaults or {}).get(f.param, dialect.defaults.get(f.param))
        out[f.param] = _OFF[f.param] if v is None else v
    return out

