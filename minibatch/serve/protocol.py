"""The wire format: OpenAI's ``/v1/completions`` request and response bodies, validated with pydantic.

Why a strict model: a server's first duty is to say *clearly* what was wrong
with a request and keep serving. Unknown fields are refused (a typo such as
``max_token`` must not silently fall back to a default), types are strict (no
``"16"`` for 16), and sampling values are checked by ``SamplingParams`` itself,
so the server and ``LLM.generate`` accept exactly the same requests.

``logprobs`` (the top N, N <= ``MAX_LOGPROBS``), ``echo`` (the prompt before the completion; with
``logprobs``, scored: ``max_tokens: 0`` scores a prompt and generates nothing), ``presence_penalty``,
``frequency_penalty`` and ``logit_bias`` are OpenAI's; ``top_k``, ``repetition_penalty``, ``min_tokens``,
``stop_token_ids``, ``prompt_logprobs``, ``ignore_eos`` and ``return_token_ids`` are vLLM's extensions (pass them with
``extra_body`` from the ``openai`` client). ``best_of`` and ``suffix`` are accepted only at their
defaults, so a stock client works and a request that relies on them gets a 400 instead of a quietly
different answer.
Structured outputs come as OpenAI's ``response_format``, or as vLLM's extra-body
``structured_outputs`` ({"json" | "regex" | "choice" | "grammar" | "json_object": ...}) or its older
``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar``; a constraint that does not
compile, or admits no string, is a 400 (``SamplingParams`` compiles it).
"""
from __future__ import annotations

import codecs
import time
from typing import Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator

from minibatch.sampling.sampler import SamplingParams
from minibatch.model.tokenizer import decode

_UNSUPPORTED_DEFAULTS = {"best_of": None, "suffix": None}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False
    continuous_usage_stats: bool = False        # vLLM extension: usage so far in every chunk (guidellm asks for it)


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    name: str = "schema"
    description: Optional[str] = None
    schema_: dict = Field(alias="schema")       # ("schema" would shadow pydantic's BaseModel.schema)
    strict: Optional[bool] = None


class ResponseFormat(BaseModel):
    """OpenAI's ``response_format``: {"type": "text" | "json_object" | "json_schema", "json_schema": {...}}."""
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchemaFormat] = None


# vLLM's older extra-body names for structured outputs -> StructuredOutputsParams' fields
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


class CompletionRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    prompt: Union[str, list[str], list[int], list[list[int]]]
    model: Optional[str] = None                 # None: the one served model
    max_tokens: Optional[int] = 16              # None: up to the end of the context
    temperature: float = 1.0                    # OpenAI's defaults
    top_p: float = 1.0
    top_k: int = -1                             # vLLM extension
    seed: Optional[int] = None
    stop: Union[str, list[str], None] = None
    n: int = 1
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[str] = None                  # accepted and ignored, as by OpenAI
    return_token_ids: bool = False              # vLLM extension: token ids in each choice
    echo: bool = False                          # the prompt before the completion (scored with logprobs)
    logprobs: Optional[int] = None              # the top N per token, N <= MAX_LOGPROBS
    # structured outputs: OpenAI's response_format, vLLM's structured_outputs, or vLLM's older guided_* names
    response_format: Optional[ResponseFormat] = None
    structured_outputs: Optional[dict] = None
    guided_json: Union[str, dict, None] = None
    guided_regex: Optional[str] = None
    guided_choice: Optional[list[str]] = None
    guided_grammar: Optional[str] = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Optional[dict[str, float]] = None   # {"token id": bias in [-100, 100]}
    repetition_penalty: float = 1.0             # vLLM extensions (sampling/logits_processors.py)
    min_tokens: int = 0
    stop_token_ids: Optional[list[int]] = None
    prompt_logprobs: Optional[int] = None       # vLLM extension: each choice's "prompt_logprobs"
    ignore_eos: bool = True                     # vLLM extension (load generators send it); a byte model has no EOS
    # OpenAI fields minibatch does not implement: accepted at their defaults only
    best_of: Optional[int] = None
    suffix: Optional[str] = None

    @model_validator(mode="after")
    def _refuse_unimplemented(self):
        for name, default in _UNSUPPORTED_DEFAULTS.items():
            value = getattr(self, name)
            if value != default and not (name == "best_of" and value == self.n):
                raise ValueError(f"`{name}` is not supported by minibatch (got {value!r}); leave it at {default!r}")
        if self.stream_options is not None and not self.stream:
            raise ValueError("`stream_options` is only allowed with `stream: true`")
        if self.echo and self.stream:
            raise ValueError("`echo` is supported without `stream` only")
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("`max_tokens: 0` is allowed only with `echo: true` (to score a prompt)")
        given = [n for n in ("response_format", "structured_outputs", *_GUIDED) if getattr(self, n) is not None]
        if len(given) > 1:
            raise ValueError(f"give one structured-outputs field, not {given}")
        rf = self.response_format
        if rf is not None and (rf.type == "json_schema") != (rf.json_schema is not None):
            raise ValueError("response_format: `json_schema` is required with type 'json_schema', and only then")
        return self

    def structured_outputs_fields(self) -> Optional[dict]:
        """The request's constraint as StructuredOutputsParams' fields (None: unconstrained)."""
        rf = self.response_format
        if rf is not None:
            return None if rf.type == "text" else (
                {"json_object": True} if rf.type == "json_object" else {"json": rf.json_schema.schema_})
        if self.structured_outputs is not None:
            return self.structured_outputs
        return next(({field: getattr(self, n)} for n, field in _GUIDED.items() if getattr(self, n) is not None), None)

    def prompts(self) -> list:
        """The prompts as a list: each a str or a list of token ids (bytes)."""
        p = self.prompt
        if isinstance(p, str) or not p or isinstance(p[0], int):    # [] is one empty prompt: the engine says so
            return [p]
        return list(p)

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        """Raises ValueError for bad values, with SamplingParams' own message."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        prompt_logprobs = self.prompt_logprobs         # max_tokens 0 (echo): one token runs, and is not returned
        if self.echo and self.logprobs is not None:           # an echoed prompt is scored as well
            prompt_logprobs = max(self.logprobs, prompt_logprobs or 0)
        return SamplingParams(n=self.n, temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
                              max_tokens=max_tokens or 1, seed=self.seed, stop=stop, logprobs=self.logprobs,
                              prompt_logprobs=prompt_logprobs, presence_penalty=self.presence_penalty,
                              frequency_penalty=self.frequency_penalty, repetition_penalty=self.repetition_penalty,
                              logit_bias=self.logit_bias, min_tokens=self.min_tokens,
                              stop_token_ids=list(self.stop_token_ids or []),
                              structured_outputs=self.structured_outputs_fields())


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)     # vLLM's other fields (add_special_tokens...)
    prompt: str
    model: Optional[str] = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    tokens: list[int]
    model: Optional[str] = None

    @model_validator(mode="after")
    def _bytes(self):
        if not all(0 <= t < 256 for t in self.tokens):
            raise ValueError("tokens must be byte values in [0, 256)")
        return self


def error_body(message: str, type_: str = "invalid_request_error", param: Optional[str] = None,
               code: Optional[Union[int, str]] = None) -> dict:
    """OpenAI's error object: {"error": {"message", "type", "param", "code"}}."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def validation_message(errors: list) -> tuple[str, Optional[str]]:
    """pydantic's error list -> one readable line and the first offending field."""
    parts, param = [], None
    for e in errors:
        loc = [str(x) for x in e.get("loc", ()) if x != "body"]
        if e.get("type") == "json_invalid":
            ctx = e.get("ctx", {}).get("error", "")
            parts.append(f"the body is not valid JSON ({ctx})" if ctx else "the body is not valid JSON")
            continue
        field = loc[0] if loc else None
        param = param or field
        where = ".".join(loc)
        msg = e.get("msg", "invalid").removeprefix("Value error, ")
        if e.get("type") == "extra_forbidden":
            msg = "unknown field (not part of the completions API)"
        parts.append(f"{where}: {msg}" if where else msg)
    return "; ".join(dict.fromkeys(parts)) or "invalid request", param


class TextDelta:
    """One choice's streamed text: the new tokens since the last chunk, decoded incrementally.

    Two things are held back until they are certain: the bytes of a UTF-8
    character split across tokens (the incremental decoder keeps them), and a
    tail that could still grow into a stop string (the engine cuts the output
    before a stop string, so those bytes may never be part of the answer)."""

    def __init__(self, stop: list):
        self.sent = 0
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._stops = [s.encode("utf-8") for s in stop]

    def _held(self, data: bytes) -> int:
        """Length of the longest tail of ``data`` that is a proper prefix of a stop string."""
        best = 0
        for s in self._stops:
            for k in range(min(len(s) - 1, len(data)), best, -1):
                if data.endswith(s[:k]):
                    best = k
                    break
        return best

    def update(self, token_ids: list, finished: bool) -> tuple[str, list]:
        """(text, token ids) to send now for a choice whose output is ``token_ids`` so far."""
        end = len(token_ids) if finished else len(token_ids) - self._held(bytes(token_ids))
        end = max(end, self.sent)
        new = list(token_ids[self.sent:end])
        self.sent = end
        return self._decoder.decode(bytes(new), final=finished), new


def now() -> int:
    return int(time.time())


def completion_body(request_id: str, model: str, choices: list, usage: Optional[dict]) -> dict:
    body = {"id": request_id, "object": "text_completion", "created": now(), "model": model, "choices": choices}
    if usage is not None:
        body["usage"] = usage
    return body


def choice(index: int, text: str, finish_reason: Optional[str], token_ids: Optional[list] = None,
           logprobs: Optional[dict] = None) -> dict:
    c = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
    if token_ids is not None:
        c["token_ids"] = token_ids
    return c


def completion_logprobs(token_ids: list, entries: list, num: int, offset: int = 0) -> dict:
    """OpenAI's completions ``logprobs`` object for ``token_ids``, whose engine entries are ``entries``
    ([{token: Logprob}], None for an echoed prompt's first token): ``tokens``, ``token_logprobs``,
    ``top_logprobs`` (the top ``num``, keyed by decoded text; the chosen token is among them) and
    ``text_offset`` (characters into the choice's text, whose first ``offset`` characters came before)."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for i, (t, e) in enumerate(zip(token_ids, entries)):
        out["text_offset"].append(offset + len(decode(token_ids[:i])))
        out["tokens"].append(decode([t]))
        if e is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        out["token_logprobs"].append(e[t].logprob)
        top = {}
        for tok, lp in sorted(e.items(), key=lambda kv: kv[1].rank):
            if lp.rank <= num or tok == t:
                top.setdefault(decode([tok]), lp.logprob)
        out["top_logprobs"].append(top)
    return out


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}
