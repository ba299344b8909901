"""The weight transport protocol: what a transport carries (a :class:`Payload`, one
version's tensors under a :class:`Header` that says what they are), where to
(a :class:`Destination`) and how (a :class:`Transport`: ``send``, ``revive``, ``close``).

The header is the versioned part of the transport protocol: ``protocol`` (the layout of
headers and deliveries, :data:`PROTOCOL`), the weight ``version``, the payload ``kind`` and
each tensor's name, dtype and shape. A receiver checks it before it installs anything
(:func:`check`): a payload of another protocol, or of a kind the receiver cannot apply, is
refused with the reason, never half-applied.

Kinds: ``full`` (a whole Hugging Face-named state dict, what ``Engine.load_weights`` takes),
``delta`` (what changed from the version ``base`` to ``version``, in the engine's dtype:
``delta.py``, which makes and applies it; only an engine that holds ``base`` applies it) and
``adapter`` (a LoRA adapter alone, :func:`check_adapter`: for each adapted linear layer
``M``, ``M.lora_A.weight`` [r, d_in] and ``M.lora_B.weight`` [d_out, r] with the adapter's
scale already multiplied into B, so version ``v`` serves ``M.weight = base + B @ A`` where
base is the weights the engine last loaded in full, its folder's at start: each adapter
version replaces the previous one, it never adds to it). The transports move any kind
unchanged, since they move tensors and this header, but no receiver of theirs applies an
adapter yet (:data:`KINDS`): it reaches the embedded engine in process, and the vLLM engine,
which hands it to its server as a PEFT folder (``vllm_lora.py``). An adapter is never
delta-encoded: every one of its elements moves each step, and it is already the small payload.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol, get_args

if TYPE_CHECKING:
    import torch

IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers some checkpoints carry; engines derive them
PROTOCOL = 1  # the layout of a header and of the transports' deliveries
PayloadKind = Literal["full", "delta", "adapter"]
ADAPTER_SUFFIXES = (".lora_A.weight", ".lora_B.weight")  # an adapter payload's names
PEFT_PREFIX = "base_model.model."  # what peft puts before the base model's module names
ADAPTER_FILE = "adapter_model.safetensors"  # a peft adapter folder's weights
# what the transports' receivers apply (engine actors, vLLM's full reload): an adapter reaches
# the engines of this process alone (weights.py; vLLM's through vllm_lora.py), so a transport
# refuses one, never half-applies it
KINDS: tuple[str, ...] = tuple(k for k in get_args(PayloadKind) if k != "adapter")


@dataclass(frozen=True, slots=True, kw_only=True)
class TensorMeta:
    name: str  # Hugging Face parameter name
    dtype: str  # torch dtype without its module: "float32", "bfloat16"
    shape: tuple[int, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class Header:
    version: int  # the weight version the tensors are; tokens sampled with them carry it
    kind: PayloadKind
    tensors: tuple[TensorMeta, ...]
    protocol: int = PROTOCOL
    base: int | None = None  # a delta's: the version it applies to (None for full)

    @classmethod
    def describe(cls, version: int, kind: PayloadKind,
                 tensors: Mapping[str, torch.Tensor], base: int | None = None) -> Header:
        if (kind == "delta") != (base is not None):
            raise ValueError(f"a {kind} payload with base {base}: a delta, and only a delta, "
                             "names the version it applies to")
        return cls(version=version, kind=kind, base=base, tensors=tuple(
            TensorMeta(name=name, dtype=str(t.dtype).removeprefix("torch."),
                       shape=tuple(t.shape)) for name, t in tensors.items()))

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(m.name for m in self.tensors)

    def metadata(self) -> dict[str, str]:
        """The fields a file format's string metadata keeps (safetensors'): the names,
        dtypes and shapes are in the file's own header."""
        meta = {"rollstream.protocol": str(self.protocol), "rollstream.version":
                str(self.version), "rollstream.kind": self.kind}
        if self.base is not None:
            meta["rollstream.base"] = str(self.base)
        return meta


@dataclass(frozen=True, slots=True, kw_only=True)
class Payload:
    header: Header
    tensors: Mapping[str, torch.Tensor]

    @classmethod
    def full(cls, version: int, tensors: Mapping[str, torch.Tensor]) -> Payload:
        """A whole state dict as ``version`` (the tensors are not copied)."""
        return cls(header=Header.describe(version, "full", tensors), tensors=tensors)

    @property
    def version(self) -> int:
        return self.header.version

    def open(self, group: Any = None) -> Payload:
        """:class:`Delivery`: the object store delivers the payload itself."""
        check(self.header.protocol, self.header.kind)
        return self


@dataclass(frozen=True, slots=True, kw_only=True)
class Destination:
    """Where one engine's weights are installed: its engine actor
    (``runtime/ray/engine_actor.py``), whose ``install(delivery)`` opens what a transport
    sent. A destination on another node is the same actor handle; a transport that cannot
    reach it from here (shared memory) says so where it is built (``RayConfig``)."""

    engine_id: str
    actor: Any  # a Ray actor handle
    node_id: str | None = None  # Ray's id of the node the actor runs on (None: not known)


@dataclass(frozen=True, slots=True, kw_only=True)
class SyncRecord:
    """One payload sent to one engine: what a weight sync moved to it."""

    version: int
    engine_id: str
    transport: str  # a Transport's name, or IN_PROCESS (weights.py)
    kind: str  # "full", "delta" or "adapter"
    num_bytes: int  # the payload's tensor bytes
    dtype: str  # the dtype the values are in (several joined by "+")
    full_bytes: int  # what the full version is, in that dtype
    seconds: float

    @classmethod
    def of(cls, version: int, engine_id: str, transport: str,
           tensors: Mapping[str, torch.Tensor], seconds: float) -> SyncRecord:
        """A record of ``tensors`` moved as they are (no delta, no cast)."""
        num_bytes = payload_bytes(tensors)
        return cls(version=version, engine_id=engine_id, transport=transport,
                   kind="adapter" if is_adapter(tensors) else "full", num_bytes=num_bytes,
                   dtype=dtype_name(tensors), full_bytes=num_bytes, seconds=seconds)


def payload_bytes(tensors: Mapping[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def dtype_name(tensors: Mapping[str, torch.Tensor]) -> str:
    """The tensors' dtype without its module ("float32"); several joined by "+"."""
    return "+".join(sorted({str(t.dtype).removeprefix("torch.") for t in tensors.values()}))


class Delivery(Protocol):
    """What a transport hands a destination for one payload: the payload itself (object
    store), a broadcast round's bucket plan, a shared-memory folder. The destination calls
    ``open`` (blocking: off its event loop), so a new transport needs no new actor method."""

    def open(self, group: Any) -> Payload:
        """The payload, checked (:func:`check`); ``group``: the destination's broadcast
        group, if it joined one."""
        ...


class Transport(Protocol):
    """Carries payloads from this process to destinations. Sends of one payload's tensors
    (the same mapping: weight sync hands every engine the same one) to several destinations
    form one round, so a version travels once for all of them; rounds never overlap."""

    name: str  # as ``runtime.ray.weight_sync`` names it: the dashboard's and the log's word

    async def send(self, payload: Payload, to: Destination) -> None:
        """Install ``payload`` at ``to`` (raises the destination's errors)."""

    async def revive(self, payload: Payload, to: Destination) -> None:
        """The same for one new destination (an engine that replaced a dead one), outside
        the rounds."""

    def close(self) -> None:
        """Free what the transport holds (idempotent)."""


def check(protocol: int, kind: str, kinds: tuple[str, ...] = KINDS) -> None:
    """Refuse a payload this receiver cannot apply (ValueError with the reason)."""
    if protocol != PROTOCOL:
        raise ValueError(f"weight payload of transport protocol {protocol}; this rollstream "
                         f"reads protocol {PROTOCOL} (trainer and engines must run one version)")
    if kind not in kinds:
        raise ValueError(f"weight payload of kind {kind!r} cannot be applied here "
                         f"(accepted: {', '.join(kinds)})")


def read_metadata(meta: Mapping[str, str] | None, where: str, kinds: tuple[str, ...] = KINDS
                  ) -> tuple[int, PayloadKind, int | None]:
    """The version, kind and base :meth:`Header.metadata` wrote, checked (``where``: the
    file; ``kinds``: those the reader applies)."""
    meta = meta or {}
    try:
        protocol, version = int(meta["rollstream.protocol"]), int(meta["rollstream.version"])
        kind = meta["rollstream.kind"]
        base = int(meta["rollstream.base"]) if "rollstream.base" in meta else None
    except (KeyError, ValueError) as e:
        raise ValueError(f"{where}: not a rollstream weight payload (metadata {meta}): "
                         f"{e!r}") from None
    check(protocol, kind, kinds)
    return version, kind, base  # type: ignore[return-value]  # checked against KINDS


def check_full(tensors: Mapping[str, torch.Tensor], shapes: Mapping[str, tuple[int, ...]], *,
               optional: Collection[str] = (),
               model: str) -> list[tuple[str, torch.Tensor]]:
    """What an engine installs of a ``full`` payload, checked against the names and shapes
    of the model it serves (``model`` names it in errors): every name of ``shapes`` but the
    ``optional`` ones (a tied ``lm_head.weight``) must come, with its shape; an optional
    name the model does not hold and rotary ``inv_freq`` buffers are dropped; any other name
    is an error. ValueError before anything is installed."""
    pairs, unknown = [], []
    for name, t in tensors.items():
        expected = shapes.get(name)
        if expected is None:
            if not (name.endswith(IGNORED_SUFFIXES) or name in optional):
                unknown.append(name)
        elif tuple(t.shape) != tuple(expected):
            raise ValueError(f"weight {name}: shape {tuple(t.shape)} != expected "
                             f"{tuple(expected)}")
        else:
            pairs.append((name, t))
    if unknown:
        raise ValueError(f"unknown weight names (not in {model}): {sorted(unknown)[:5]}")
    missing = set(shapes) - set(optional) - {n for n, _ in pairs}
    if missing:
        raise ValueError(f"weights missing from the update: {sorted(missing)[:5]} "
                         f"({len(missing)} in all); load_weights takes a full state dict")
    return pairs


def is_adapter(names: Collection[str]) -> bool:
    """Whether tensors of these names are an ``adapter`` payload (every name ends in an
    adapter suffix); ValueError for a mix of adapter and other names."""
    ends = [n.endswith(ADAPTER_SUFFIXES) for n in names]
    if any(ends) and not all(ends):
        odd = sorted(n for n, e in zip(names, ends) if not e)[:3]
        raise ValueError(f"a weight payload mixes adapter tensors ({ADAPTER_SUFFIXES}) with "
                         f"others ({odd}): send a full state dict or an adapter alone")
    return bool(ends) and all(ends)


def check_adapter(tensors: Mapping[str, torch.Tensor], shapes: Mapping[str, tuple[int, ...]],
                  *, model: str) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """An ``adapter`` payload checked against the weights of the model an engine serves
    (``shapes``: HF name -> shape; ``model`` names it in errors): per adapted weight
    ``(M.weight, A, B)``, each ``M.weight`` a 2-D weight of the model, ``A`` [r, d_in] and
    ``B`` [d_out, r] of one rank r. ValueError before anything is installed."""
    a_end, b_end = ADAPTER_SUFFIXES
    modules = sorted({n.removesuffix(a_end).removesuffix(b_end) for n in tensors})
    out = []
    for m in modules:
        a, b, weight = tensors.get(m + a_end), tensors.get(m + b_end), m + ".weight"
        if a is None or b is None:
            raise ValueError(f"adapter for {m}: needs both {m + a_end} and {m + b_end}")
        shape = shapes.get(weight)
        if shape is None or len(shape) != 2:
            raise ValueError(f"adapter for {m}: {weight} is not a matrix of {model}")
        if a.dim() != 2 or b.dim() != 2 or tuple(b.shape) != (shape[0], a.shape[0]) \
                or a.shape[1] != shape[1]:
            raise ValueError(f"adapter for {m}: A {tuple(a.shape)} and B {tuple(b.shape)} do "
                             f"not make a delta of {weight}'s shape {tuple(shape)} "
                             "(A: [r, d_in], B: [d_out, r])")
        out.append((weight, a, b))
    return out
