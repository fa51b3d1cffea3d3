"""A parsed request as an engine takes it (``build_work_item``): its prompt tokenized (``add_special_tokens``,
``truncate_prompt_tokens``), its sampling and output parameters as the engines take them (``SamplingParams``,
``StopParams``), with the model's generation_config defaults for the sampling fields it left out, and the
checks that need the model: token ids in the vocabulary, ``min_tokens`` within the request's max_tokens.

Both workers of a P/D request build them from the same body (prefill with the client's max_tokens from
``kv_transfer_params``), so prefill's first token and decode's rest are sampled and stopped alike.
"""

from __future__ import annotations

from typing import Any

from xpyd.api.openai import APIError, CompletionRequest, RequestKind
from xpyd.api.local_prefill import LOCAL_PREFILL_KEY
from xpyd.api.resume import RESUME_KEY
from xpyd.model.loader import GenerationDefaults
from xpyd.model.output import StopParams
from xpyd.model.sampling_params import SamplingParams
from xpyd.model.tokenizer import encode_chat, encode_prompt
from xpyd.signal.request_id import RequestId
from xpyd.worker.config import WorkerConfig
from xpyd.worker.work_item import OutputSink, WorkItem


def _pick(value, default, fallback):
    if value is not None:
        return value
    return default if default is not None else fallback


def _check_ids(ids, vocab: int, param: str) -> None:
    bad = [t for t in ids if t >= vocab]
    if bad:
        raise APIError(400, f"'{param}' names token id {bad[0]}, outside the vocabulary [0, {vocab})", param=param)


def sampling_params(req: CompletionRequest, defaults: GenerationDefaults, eos_token_ids: frozenset[int],
                    vocab: int) -> SamplingParams:
    """The request's sampling parameters (400 for a token id outside ``vocab``)."""
    _check_ids([t for t, _ in req.logit_bias], vocab, "logit_bias")
    _check_ids(req.stop_token_ids, vocab, "stop_token_ids")
    try:
        return SamplingParams(
            temperature=_pick(req.temperature, defaults.temperature, 1.0),
            top_p=_pick(req.top_p, defaults.top_p, 1.0),
            top_k=max(0, _pick(req.top_k, defaults.top_k, 0)),
            seed=req.seed,
            min_p=_pick(req.min_p, defaults.min_p, 0.0),
            presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty,
            repetition_penalty=_pick(req.repetition_penalty, defaults.repetition_penalty, 1.0),
            min_tokens=req.min_tokens,
            min_tokens_ids=frozenset(eos_token_ids) | frozenset(req.stop_token_ids),
            logit_bias=req.logit_bias,
        )
    except ValueError as e:
        raise APIError(400, str(e)) from None


def stop_params(req: CompletionRequest, max_tokens: int, eos_token_ids: frozenset[int]) -> StopParams:
    """How the request's output ends and is written (400 for ``min_tokens`` above ``max_tokens``)."""
    if req.min_tokens > max_tokens:
        raise APIError(400, f"'min_tokens' ({req.min_tokens}) must be at most max_tokens ({max_tokens})",
                       param="min_tokens")
    return StopParams(max_tokens=max_tokens, stop=tuple(req.stop), ignore_eos=req.ignore_eos,
                      eos_token_ids=eos_token_ids, stop_token_ids=frozenset(req.stop_token_ids),
                      include_stop_str_in_output=req.include_stop_str_in_output, min_tokens=req.min_tokens,
                      skip_special_tokens=req.skip_special_tokens,
                      spaces_between_special_tokens=req.spaces_between_special_tokens)


def build_work_item(engine: Any, config: WorkerConfig, req: CompletionRequest, rid: RequestId,
                    sink: OutputSink, defaults: GenerationDefaults = GenerationDefaults()) -> WorkItem:
    """Validate and tokenize; raise APIError (4xx) for anything the client got wrong.

    Prefill, which has the same request, tokenizes and checks it, and its "ready" carries the prompt's length
    and block hashes (the decode engine finishes the length checks then). A decode worker tokenizes too: a
    request it preempts computes its prompt again here (``xpyd.worker.preemption``), and it caches the KV it
    pulls only under block hashes it computed itself, refusing a prompt that prefill names otherwise
    (``DecodeEngine._prompt_facts``). ``defaults``: the model's generation_config."""
    served = engine.info.model_id
    if req.model is not None and req.model != served:
        raise APIError(404, f"The model `{req.model}` does not exist.", "NotFoundError", "model")
    sampling = sampling_params(req, defaults, engine.eos_token_ids, len(engine.tokenizer))
    decode = config.role == "decode"
    limit = engine.max_model_len
    kvp = req.kv_transfer_params or {}
    local = decode and _local_prefill(kvp)  # (a decode worker that prefills the request itself)
    ids = _tokenize(engine.tokenizer, req, limit)
    n = len(ids)
    resumed = _resumed(kvp, len(engine.tokenizer), limit)
    max_tokens = kvp["max_tokens"] if "max_tokens" in kvp else req.max_tokens
    least = 0 if req.echo and not decode else 1  # (0: the prompt alone, never a decode worker's part)
    if max_tokens is not None and (not isinstance(max_tokens, int) or isinstance(max_tokens, bool)
                                   or max_tokens < least):
        raise APIError(400, "kv_transfer_params.max_tokens must be a positive integer", param="kv_transfer_params")
    prompt_only = max_tokens == 0
    if n >= limit:
        raise APIError(400, f"This model's maximum context length is {limit} tokens. However, your request has "
                       f"{n} input tokens. Please reduce the length of the input.", param="prompt")
    open_ended = max_tokens is None
    if open_ended:
        max_tokens = limit - n
    if n + max_tokens > limit:
        raise APIError(400, f"This model's maximum context length is {limit} tokens. However, you requested "
                       f"{n + max_tokens} tokens ({n} in the input, {max_tokens} in the completion). Please "
                       "reduce the length of the input or the completion.", param="max_tokens")
    if resumed and (len(resumed) >= max_tokens or req.echo or req.prompt_scores is not None):
        raise APIError(400, f"{RESUME_KEY} must be shorter than max_tokens ({max_tokens}) and comes without echo "
                       "or prompt_logprobs", param="kv_transfer_params")
    stop = stop_params(req, max(1, max_tokens), engine.eos_token_ids)
    return WorkItem(request_id=rid, prompt_ids=ids + list(resumed), sampling=sampling, stop=stop,
                    sink=sink, open_ended=open_ended, cache_salt=req.cache_salt, logprobs=req.logprobs,
                    prompt_scores=None if decode else req.prompt_scores, prompt_only=prompt_only,
                    grammar=_matcher(engine, req), resumed=resumed, local_prefill=local)


def _local_prefill(kvp: dict) -> bool:
    """Whether the proxy asks this decode worker to prefill the request itself (``xpyd.api.local_prefill``)."""
    value = kvp.get(LOCAL_PREFILL_KEY, False)
    if not isinstance(value, bool):
        raise APIError(400, f"kv_transfer_params.{LOCAL_PREFILL_KEY} must be true or false", param="kv_transfer_params")
    return value


def _resumed(kvp: dict, vocab: int, limit: int) -> tuple[int, ...]:
    """A migrated request's output so far (``kv_transfer_params.resume_token_ids``, from the proxy): token ids
    in the vocabulary, fewer than the context holds; () when it is not one."""
    ids = kvp.get(RESUME_KEY)
    if ids is None:
        return ()
    if not isinstance(ids, list) or not ids or len(ids) >= limit or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in ids):
        raise APIError(400, f"kv_transfer_params.{RESUME_KEY} must be a non-empty list of at most {limit - 1} token "
                       f"ids in [0, {vocab})", param="kv_transfer_params")
    return tuple(ids)


def _matcher(engine: Any, req: CompletionRequest):
    """The request's grammar matcher (structured output), or None; a 400 naming the field for a grammar the engine
    cannot compile."""
    c = req.constraint
    if c is None:
        return None
    from xpyd.model.grammar import GrammarError, GrammarSpec

    try:
        return engine.grammars().matcher(GrammarSpec(c.kind, c.value))
    except GrammarError as e:
        raise APIError(400, f"'{c.param}': {e}", param=c.param) from None


def _truncated(n: int, req: CompletionRequest, limit: int) -> int:
    """How many of a prompt's ``n`` tokens ``truncate_prompt_tokens`` keeps (its last ones, or with
    ``truncation_side`` right its first)."""
    k = req.truncate_prompt_tokens
    return n if k is None else min(n, limit if k == -1 else k)


def _tokenize(tokenizer, req: CompletionRequest, limit: int) -> list[int]:
    """The prompt's ids: its special tokens as ``add_special_tokens`` says, then ``truncate_prompt_tokens``."""
    chat = req.kind is RequestKind.CHAT
    add = req.add_special_tokens if req.add_special_tokens is not None else not chat
    try:
        if chat:
            ids = encode_chat(tokenizer, req.messages or [], add_special_tokens=add, template_args=req.chat.as_kwargs())
        else:
            ids = encode_prompt(tokenizer, req.prompt if req.prompt is not None else "", add_special_tokens=add)
    except ValueError as e:  # (a request's own template is named when rendering failed)
        param = ("chat_template" if req.chat.template is not None else "messages") if chat else "prompt"
        raise APIError(400, str(e), param=param) from None
    if not ids:
        raise APIError(400, "The prompt is empty.", param="prompt")
    keep = _truncated(len(ids), req, limit)
    return ids[:keep] if req.truncation_side == "right" else ids[len(ids) - keep:]
