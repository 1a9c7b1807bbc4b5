"""SGLang-shaped JSON bodies of /generate -> checked generation requests.

Every field is checked by hand so that a refusal names the field and the fix, and so that nothing a
client sends (wrong types, NaN, unknown keys, absurd sizes) reaches an engine's scheduler. The
control routes' bodies are typed models instead (bodies.py).
Non-goal: every SGLang option. Options that would change results and are not implemented are
refused rather than silently ignored; a few that do not change results are accepted.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field

from miles.engine_api.errors import InvalidRequest
from miles.engine_api.sampling import SamplingParams

# Bound on any single list a client may send, far above any real request; keeps a hostile body
# from costing more than its parse.
MAX_ITEMS = 1 << 20
# Stop strings are matched against the decoded tail of every row at every decode step, so their
# number and length are bounded well below anything a client could need.
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 1024
MAX_RID_CHARS = 1024
# top_k beyond the vocabulary means the whole vocabulary; bounded so it fits the sampler's int64 tensors.
MAX_TOP_K = (1 << 31) - 1
# A prompt as text may not be longer than this many characters per token of context: no tokenizer
# packs more into one token, and it keeps tokenizing a hostile prompt cheap.
MAX_CHARS_PER_TOKEN = 64
# Below this SGLang treats the temperature as greedy; dividing by it would overflow anyway.
GREEDY_EPS = 1e-6

_SAMPLING_KEYS = {"temperature", "top_p", "top_k", "min_p", "max_new_tokens", "stop", "stop_token_ids",
                  "ignore_eos", "sampling_seed", "skip_special_tokens", "no_stop_trim", "n"}
_GENERATE_KEYS = {"input_ids", "text", "sampling_params", "return_logprob", "rid", "stream",
                  "return_text_in_logprobs", "logprob_start_len", "top_logprobs_num", "return_routed_experts",
                  "lora_path", "image_data"}


# SGLang request fields that clients (sglang-router among them) send with their defaults. They are
# accepted at exactly those defaults; any other value would change the result and is refused.
_INERT_AT_DEFAULT = {"model": None, "return_hidden_states": False, "background": False, "return_bytes": False,
                     "return_entropy": False, "audio_data": None,
                     "video_data": None, "custom_logit_processor": None, "data_parallel_rank": None}
# Logging switches with no effect on the output.
_BOOKKEEPING = {"log_metrics", "no_logs"}


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def parse_json(raw: bytes) -> dict:
    """A JSON object, or InvalidRequest for anything else: malformed, NaN or Infinity, nested past
    Python's recursion limit, or holding a lone UTF-16 surrogate (it has no UTF-8 form, so it could
    reach neither the tokenizer nor a response)."""
    def no_constants(name):
        raise InvalidRequest(f"body: {name} is not valid JSON; send finite numbers")

    try:
        body = json.loads(raw or b"null", parse_constant=no_constants)
    except InvalidRequest:
        raise
    except RecursionError:
        raise InvalidRequest("body: JSON nested too deeply; no request nests more than a few levels") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidRequest(f"body: malformed JSON ({exc})") from None
    if not isinstance(body, dict):
        raise InvalidRequest("body: expected a JSON object")
    if _SURROGATE_ESCAPE.search(raw):  # paired surrogates are fine; look closer only when there are any
        try:
            json.dumps(body, ensure_ascii=False).encode()
        except UnicodeEncodeError:
            raise InvalidRequest(f"{_surrogate_at(body)}: holds a lone UTF-16 surrogate, which is not text; "
                                 "send valid Unicode") from None
    return body


def _surrogate_at(body: dict) -> str:
    """The path of the first string (key or value) that cannot be encoded as UTF-8."""
    stack = [("", body)]
    while stack:
        path, v = stack.pop()
        items = v.items() if isinstance(v, dict) else enumerate(v) if isinstance(v, list) else ()
        for k, child in items:
            name = str(k).encode(errors="backslashreplace").decode()  # the path itself must be printable
            here = f"{path}.{name}".lstrip(".") if isinstance(v, dict) else f"{path}[{k}]"
            for s in ((k, child) if isinstance(v, dict) else (child,)):
                if isinstance(s, str):
                    try:
                        s.encode()
                    except UnicodeEncodeError:
                        return here
            stack.append((here, child))
    return "body"


@dataclass(frozen=True)
class GenerateItem:
    input_ids: list[int]
    params: SamplingParams
    return_logprob: bool
    rid: str | None
    return_routed_experts: bool = False
    lora_path: str | None = None  # the name of a loaded LoRA adapter (SGLang's field); None: the default
    # SGLang's logprob_start_len: -1 = output tokens only; k >= 0 = also the prompt's tokens from position k.
    logprob_start_len: int = -1
    image_data: list = field(default_factory=list)  # SGLang's: the prompt's images (base64 or data: URLs), in order


def parse_generate(body: dict, tokenizer, default_max_new_tokens: int,
                   context_length: int | None = None) -> tuple[list[GenerateItem], bool]:
    """Returns the items and whether the client sent a batch (and so expects a JSON list back).

    Tokenizes text prompts, so callers on an event loop run it on a thread."""
    _no_unknown(body, _GENERATE_KEYS | set(_INERT_AT_DEFAULT) | _BOOKKEEPING, "")
    if body.get("video_data") is not None:  # Qwen-VL checkpoints take videos; the engine's vision path does not
        raise InvalidRequest("video_data: the built-in engine serves images only (image_data); send each frame "
                             "as an image, or serve videos with SGLang (rollout.engine_urls)")
    for k, default in _INERT_AT_DEFAULT.items():
        if k in body and body[k] != default:
            raise InvalidRequest(f"{k}: the built-in engine does not support {k}; send {json.dumps(default)} "
                                 "or leave it out")
    for k in _BOOKKEEPING & set(body):
        _bool(body[k], k)
    stream = _bool(body.get("stream", False), "stream")
    routed = _bool(body.get("return_routed_experts", False), "return_routed_experts")
    if body.get("top_logprobs_num", 0) not in (0, None):
        raise InvalidRequest("top_logprobs_num: top logprobs are not supported; send 0")
    # Accepted for SGLang clients; the text slot of every logprob triple stays null here.
    _bool(body.get("return_text_in_logprobs", False), "return_text_in_logprobs")
    has_ids, has_text = body.get("input_ids") is not None, body.get("text") is not None
    if has_ids == has_text:
        raise InvalidRequest("input_ids/text: send exactly one of input_ids or text")
    if has_ids:
        prompts, batched = _parse_input_ids(body["input_ids"])
    else:
        text = body["text"]
        batched = isinstance(text, list)
        texts = text if batched else [text]
        _check_len(texts, "text")
        for i, t in enumerate(texts):
            if not isinstance(t, str):
                raise InvalidRequest(f"text{_at(i, batched)}: expected a string, got {_kind(t)}")
            if context_length is not None and len(t) > MAX_CHARS_PER_TOKEN * context_length:
                raise InvalidRequest(f"text{_at(i, batched)}: {len(t)} characters cannot fit the context of "
                                     f"{context_length} tokens; shorten the prompt")
        prompts = [tokenizer.encode(t) for t in texts]
    n = len(prompts)
    if batched and n == 0:
        raise InvalidRequest("input_ids/text: the batch is empty")
    if stream and batched:
        raise InvalidRequest("stream: a streamed request takes one prompt; send one request per prompt, or the "
                             "batch with stream = false")
    params = _per_item(body.get("sampling_params"), n, batched, "sampling_params")
    logprob = _per_item(body.get("return_logprob"), n, batched, "return_logprob")
    rids = _per_item(body.get("rid"), n, batched, "rid")
    loras = _per_item(body.get("lora_path"), n, batched, "lora_path")
    starts = _per_item(body.get("logprob_start_len"), n, batched, "logprob_start_len")
    images = _images(body.get("image_data"), n, batched)
    items = []
    for i in range(n):
        where = f"sampling_params{_at(i, batched and isinstance(body.get('sampling_params'), list))}"
        sp = parse_sampling_params(params[i] if params[i] is not None else {}, default_max_new_tokens, where)
        lp = logprob[i] if logprob[i] is not None else False
        if not isinstance(lp, bool):
            raise InvalidRequest(f"return_logprob: expected true or false, got {_kind(lp)}")
        rid = rids[i]
        if rid is not None and not isinstance(rid, str):
            raise InvalidRequest(f"rid: expected a string, got {_kind(rid)}")
        if rid is not None and not 0 < len(rid) <= MAX_RID_CHARS:
            raise InvalidRequest(f"rid: send 1 to {MAX_RID_CHARS} characters, got {len(rid)}")
        lora = loras[i]
        if lora is not None and not (isinstance(lora, str) and 0 < len(lora) <= MAX_RID_CHARS):
            raise InvalidRequest(f"lora_path{_at(i, batched and isinstance(body.get('lora_path'), list))}: expected "
                                 f"the name of a loaded adapter (a string of 1 to {MAX_RID_CHARS} characters) or "
                                 f"null, got {_kind(lora)}")
        start = -1 if starts[i] is None else _int(starts[i], "logprob_start_len", lo=-1)
        if start > len(prompts[i]):
            raise InvalidRequest(f"logprob_start_len{_at(i, batched and isinstance(body.get('logprob_start_len'), list))}"
                                 f": {start} is past the prompt's {len(prompts[i])} tokens; send -1 (output tokens "
                                 "only) or a position in the prompt")
        items.append(GenerateItem(list(prompts[i]), sp, lp, rid, routed, lora, start if lp else -1, images[i]))
    return items, batched


def _images(value, n: int, batched: bool) -> list[list]:
    """Each prompt's images from SGLang's image_data: for one prompt an image or a list of them; for a
    batch one entry per prompt (an image, a list, or null). The images themselves are checked where
    they are decoded (the engine)."""
    if value is None:
        return [[] for _ in range(n)]
    if not batched:
        items = value if isinstance(value, list) else [value]
        _check_len(items, "image_data")
        return [items]
    if not isinstance(value, list) or len(value) != n:
        raise InvalidRequest(f"image_data: a batch of {n} prompts takes a list of {n} entries (each an image, "
                             f"a list of images or null), got {_kind(value)}")
    out = []
    for v in value:
        items = [] if v is None else v if isinstance(v, list) else [v]
        _check_len(items, "image_data")
        out.append(items)
    return out


def parse_sampling_params(d, default_max_new_tokens: int, where: str = "sampling_params") -> SamplingParams:
    if not isinstance(d, dict):
        raise InvalidRequest(f"{where}: expected an object, got {_kind(d)}")
    _no_unknown(d, _SAMPLING_KEYS, where + ".")
    f = lambda k: f"{where}.{k}"  # noqa: E731
    if d.get("n", 1) != 1:
        raise InvalidRequest(f"{f('n')}: only n=1 is supported; send the prompt n times instead")
    temperature = _float(d.get("temperature", 1.0), f("temperature"), lo=0.0)
    top_p = _float(d.get("top_p", 1.0), f("top_p"), lo=0.0, hi=1.0)
    if top_p == 0.0:
        raise InvalidRequest(f"{f('top_p')}: must be in (0, 1]")
    top_k = _int(d.get("top_k", -1), f("top_k"))
    if top_k == 0 or top_k < -1 or top_k > MAX_TOP_K:
        raise InvalidRequest(f"{f('top_k')}: must be -1 (whole vocabulary) or in [1, {MAX_TOP_K}], got {top_k}")
    min_p = _float(d.get("min_p", 0.0), f("min_p"), lo=0.0, hi=1.0)
    mnt = d.get("max_new_tokens")
    max_new_tokens = default_max_new_tokens if mnt is None else _int(mnt, f("max_new_tokens"), lo=0)
    stop = d.get("stop")
    stop = () if stop is None else (stop,) if isinstance(stop, str) else stop
    if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop):
        raise InvalidRequest(f"{f('stop')}: expected a non-empty string or a list of them")
    _check_len(stop, f("stop"), MAX_STOP_STRINGS)
    longest = max(stop, key=len, default="")
    if len(longest) > MAX_STOP_CHARS:
        raise InvalidRequest(f"{f('stop')}: a stop string of {len(longest)} characters is longer than the limit of "
                             f"{MAX_STOP_CHARS}")
    stop_ids = d.get("stop_token_ids") or []
    if not isinstance(stop_ids, list):
        raise InvalidRequest(f"{f('stop_token_ids')}: expected a list of token ids, got {_kind(stop_ids)}")
    _check_len(stop_ids, f("stop_token_ids"), MAX_STOP_TOKEN_IDS)
    stop_ids = [_int(t, f("stop_token_ids"), lo=0) for t in stop_ids]
    seed = d.get("sampling_seed")
    if seed is not None:
        seed = _int(seed, f("sampling_seed"), lo=0, hi=2**63 - 1)
    return SamplingParams(
        temperature=0.0 if temperature < GREEDY_EPS else temperature, top_p=top_p, top_k=top_k, min_p=min_p,
        max_new_tokens=max_new_tokens, stop=tuple(stop), stop_token_ids=tuple(stop_ids),
        ignore_eos=_bool(d.get("ignore_eos", False), f("ignore_eos")), seed=seed,
        skip_special_tokens=_bool(d.get("skip_special_tokens", True), f("skip_special_tokens")),
        no_stop_trim=_bool(d.get("no_stop_trim", False), f("no_stop_trim")))


def _parse_input_ids(ids) -> tuple[list[list[int]], bool]:
    if not isinstance(ids, list):
        raise InvalidRequest(f"input_ids: expected a list of token ids, got {_kind(ids)}")
    _check_len(ids, "input_ids")
    batched = bool(ids) and isinstance(ids[0], list)
    prompts = ids if batched else [ids]
    for i, p in enumerate(prompts):
        if not isinstance(p, list):
            raise InvalidRequest(f"input_ids{_at(i, batched)}: expected a list of token ids, got {_kind(p)}")
        _check_len(p, "input_ids")
        for t in p:
            if type(t) is not int:
                raise InvalidRequest(f"input_ids{_at(i, batched)}: token ids must be integers, got {_kind(t)}")
    return prompts, batched


def _per_item(value, n: int, batched: bool, field: str) -> list:
    """A batch field may be one value for every item or a list with one value per item."""
    if batched and isinstance(value, list):
        if len(value) != n:
            raise InvalidRequest(f"{field}: got {len(value)} values for a batch of {n}")
        return value
    return [value] * n


def no_unknown(d: dict, known: set[str]) -> None:
    _no_unknown(d, known, "")


def _no_unknown(d: dict, known: set[str], prefix: str) -> None:
    unknown = sorted(set(d) - known)
    if unknown:
        raise InvalidRequest(f"{prefix}{unknown[0]}: unknown field; supported fields are {sorted(known)}")


def _check_len(v, field: str, limit: int = MAX_ITEMS) -> None:
    if len(v) > limit:
        raise InvalidRequest(f"{field}: {len(v)} items is more than the limit of {limit}")


def _int(v, field: str, lo: int | None = None, hi: int | None = None) -> int:
    if type(v) is not int:
        raise InvalidRequest(f"{field}: expected an integer, got {_kind(v)}")
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise InvalidRequest(f"{field}: {v} is outside [{lo if lo is not None else '-inf'}, "
                             f"{hi if hi is not None else 'inf'}]")
    return v


def _float(v, field: str, lo: float | None = None, hi: float | None = None) -> float:
    if type(v) not in (int, float):
        raise InvalidRequest(f"{field}: expected a number, got {_kind(v)}")
    v = float(v)
    if not math.isfinite(v):
        raise InvalidRequest(f"{field}: must be a finite number")
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise InvalidRequest(f"{field}: {v} is outside [{lo if lo is not None else '-inf'}, "
                             f"{hi if hi is not None else 'inf'}]")
    return v


def _bool(v, field: str) -> bool:
    if not isinstance(v, bool):
        raise InvalidRequest(f"{field}: expected true or false, got {_kind(v)}")
    return v


def _string(v, field: str) -> str:
    if not isinstance(v, str):
        raise InvalidRequest(f"{field}: expected a string, got {_kind(v)}")
    return v


def _kind(v) -> str:
    return "null" if v is None else type(v).__name__


def _at(i: int, batched: bool) -> str:
    return f"[{i}]" if batched else ""
