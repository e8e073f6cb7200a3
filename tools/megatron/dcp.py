"""PyTorch distributed-checkpoint (DCP) files as Megatron's torch_dist format writes them: a pickled
`.metadata` (tensor keys, global shapes, the chunk each rank saved and where its bytes are) plus
`__<rank>_<n>.distcp` files holding each chunk as a torch.save blob.

Two implementations:
 * "torch": torch.distributed.checkpoint (torch >= 2.0) loading into torch.empty(global_shape) on a
   one-rank gloo group, as Megatron-LM tools/checkpoint/dist_checkpoint_io.py
   (load_dist_checkpoint_full) does;
 * "builtin": reads/writes the same files directly, for torch builds without a usable DCP (Debian's
   torch 1.13 has none, and its torch.distributed._shard does not import on Python 3.11). The
   builtin writer also emits multi-rank chunk layouts (a TP>1 save) from a single process.
The file format follows torch/distributed/checkpoint/{metadata.py,filesystem.py}."""

import io
import os
import pickle
import socket
import sys
import types

from common import Refusal, need_torch

MD_MOD = "torch.distributed.checkpoint.metadata"
FS_MOD = "torch.distributed.checkpoint.filesystem"


def torch_dcp():
    """The torch.distributed.checkpoint module, or None when this torch has none that imports."""
    try:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import FileSystemReader  # noqa: F401
        return dcp
    except Exception:
        return None


def _free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def one_rank_group():
    """DCP wants a default process group: a one-rank gloo group (no torchrun needed)."""
    import torch.distributed as dist
    if dist.is_initialized():
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    dist.init_process_group(backend="gloo", rank=0, world_size=1)


# ---- builtin reader ---------------------------------------------------------------------------

class _Obj:
    """Stand-in for the DCP dataclasses: keeps whatever state the pickle carries."""

    def __setstate__(self, state):
        if isinstance(state, tuple) and len(state) == 2 and (state[0] is None or isinstance(state[0], dict)):
            state = {**(state[0] or {}), **(state[1] or {})}  # (dict, slots) form
        if isinstance(state, dict):
            self.__dict__.update(state)
        else:
            self.state = state


def _stub_class(name):
    return type(name, (_Obj,), {})


class _AnyEnum:
    """Stand-in for _MEM_FORMAT_ENCODING: Python pickles an Enum member as Enum(value) or as
    getattr(Enum, name) depending on its version; either way the value is not needed."""

    def __call__(self, v):
        return v

    def __getattr__(self, n):
        return n


class _MetaUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if module.startswith("torch.distributed"):
            if name == "_MEM_FORMAT_ENCODING":
                return _AnyEnum()
            return _stub_class(name)
        return super().find_class(module, name)


def read_metadata_builtin(ckpt_dir):
    need_torch()  # torch.Size and dtypes in the pickle
    with open(os.path.join(ckpt_dir, ".metadata"), "rb") as f:
        md = _MetaUnpickler(f).load()
    return md


def _tensor_entries(md):
    """{key: (dtype, global_shape)} of the tensor entries of builtin-read metadata."""
    out = {}
    for k, v in md.state_dict_metadata.items():
        if type(v).__name__ != "TensorStorageMetadata":
            continue
        props = v.properties
        dtype = props.state[0] if hasattr(props, "state") else props.dtype
        out[k] = (dtype, tuple(v.size))
    return out


def load_builtin(ckpt_dir, want):
    """{key: tensor at its global shape} for the keys `want` (a predicate on the key)."""
    torch = need_torch()
    md = read_metadata_builtin(ckpt_dir)
    entries = {k: v for k, v in _tensor_entries(md).items() if want(k)}
    out = {k: torch.empty(shape, dtype=dt) for k, (dt, shape) in entries.items()}
    filled = {k: 0 for k in out}
    files = {}
    try:
        for idx, info in md.storage_data.items():
            key = idx.fqn
            if key not in out:
                continue
            if getattr(info, "transform_descriptors", None):
                raise Refusal("%s: chunk of %s is stored with transforms %s, which the builtin DCP reader does "
                              "not undo (use torch >= 2 with torch.distributed.checkpoint)"
                              % (ckpt_dir, key, info.transform_descriptors))
            f = files.get(info.relative_path)
            if f is None:
                f = files[info.relative_path] = open(os.path.join(ckpt_dir, info.relative_path), "rb")
            f.seek(info.offset)
            blob = f.read(info.length)
            try:
                chunk = torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)
            except TypeError:
                chunk = torch.load(io.BytesIO(blob), map_location="cpu")
            off = tuple(idx.offset) if idx.offset is not None else (0,) * out[key].dim()
            dst = out[key]
            for d, (o, n) in enumerate(zip(off, chunk.shape)):
                dst = dst.narrow(d, o, n)
            dst.copy_(chunk)
            filled[key] += chunk.numel()
    finally:
        for f in files.values():
            f.close()
    for k, n in filled.items():
        if n != out[k].numel():
            raise Refusal("%s: tensor %s: the chunks cover %d of %d elements" % (ckpt_dir, k, n, out[k].numel()))
    return out


# ---- torch reader -----------------------------------------------------------------------------

def load_torch(ckpt_dir, want):
    torch = need_torch()
    dcp = torch_dcp()
    from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    one_rank_group()
    reader = FileSystemReader(ckpt_dir)
    md = reader.read_metadata()
    sd = {}
    for k, v in md.state_dict_metadata.items():
        if isinstance(v, TensorStorageMetadata) and want(k):
            sd[k] = torch.empty(tuple(v.size), dtype=v.properties.dtype)
    load = getattr(dcp, "load", None) or dcp.load_state_dict  # torch 2.0/2.1: load_state_dict
    load(sd, storage_reader=FileSystemReader(ckpt_dir), planner=DefaultLoadPlanner())
    return sd


def tensor_keys(ckpt_dir, impl):
    if impl == "torch":
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata
        md = FileSystemReader(ckpt_dir).read_metadata()
        return [k for k, v in md.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)]
    return list(_tensor_entries(read_metadata_builtin(ckpt_dir)))


def pick_impl(impl):
    if impl in (None, "auto"):
        return "torch" if torch_dcp() else "builtin"
    if impl == "torch" and not torch_dcp():
        raise Refusal("--dcp torch: this PyTorch (%s) has no usable torch.distributed.checkpoint"
                      % need_torch().__version__)
    return impl


def load(ckpt_dir, want, impl="auto"):
    impl = pick_impl(impl)
    return (load_torch if impl == "torch" else load_builtin)(ckpt_dir, want)


# ---- writers ----------------------------------------------------------------------------------

def save_torch(ckpt_dir, sd):
    """One-rank dcp.save of whole tensors (a TP=1 torch_dist save)."""
    dcp = torch_dcp()
    from torch.distributed.checkpoint import FileSystemWriter
    one_rank_group()
    os.makedirs(ckpt_dir, exist_ok=True)
    save = getattr(dcp, "save", None) or dcp.save_state_dict
    save({k: v.contiguous() if hasattr(v, "contiguous") else v for k, v in sd.items()},
         storage_writer=FileSystemWriter(ckpt_dir))


def _fake_modules():
    """Classes pickled under the DCP module names. With a real torch.distributed.checkpoint they are
    the real ones; otherwise stand-ins registered under those names only for pickling, whose state
    matches what the real classes pickle (TensorProperties as a 5-tuple with the memory format
    encoded, see metadata.py's __getstate__)."""
    try:
        import torch.distributed.checkpoint.metadata as md
        import torch.distributed.checkpoint.filesystem as fs
        return md, fs, False
    except Exception:
        pass
    import enum
    md = types.ModuleType(MD_MOD)
    fs = types.ModuleType(FS_MOD)

    class _MEM_FORMAT_ENCODING(enum.Enum):
        TORCH_CONTIGUOUS_FORMAT = 0
        TORCH_CHANNELS_LAST = 1
        TORCH_PRESERVE_FORMAT = 2

    class TensorProperties:
        def __init__(self, dtype):
            self.dtype = dtype

        def __reduce__(self):
            import copyreg
            torch = need_torch()
            return (copyreg.__newobj__, (TensorProperties,),
                    (self.dtype, torch.strided, False, _MEM_FORMAT_ENCODING.TORCH_CONTIGUOUS_FORMAT, False))

    def plain(name, fields):
        def init(self, *a):
            for f, v in zip(fields, a):
                setattr(self, f, v)
        return type(name, (), {"__init__": init})

    classes = {
        "_MEM_FORMAT_ENCODING": _MEM_FORMAT_ENCODING, "TensorProperties": TensorProperties,
        "ChunkStorageMetadata": plain("ChunkStorageMetadata", ["offsets", "sizes"]),
        "TensorStorageMetadata": plain("TensorStorageMetadata", ["properties", "size", "chunks"]),
        "Metadata": plain("Metadata", ["state_dict_metadata", "planner_data", "storage_data"]),
        "MetadataIndex": plain("MetadataIndex", ["fqn", "offset", "index"]),
    }
    for n, c in classes.items():
        c.__module__, c.__qualname__ = MD_MOD, n
        setattr(md, n, c)
    si = plain("_StorageInfo", ["relative_path", "offset", "length"])
    si.__module__, si.__qualname__ = FS_MOD, "_StorageInfo"
    fs._StorageInfo = si
    return md, fs, True


def save_chunks(ckpt_dir, chunks):
    """Writes a DCP checkpoint from explicit chunks: chunks[key] = (global_shape, [(rank, offsets,
    tensor)]), each rank's chunks into __<rank>_0.distcp, as ranks of a TP>1 job save them."""
    torch = need_torch()
    md, fs, fake = _fake_modules()
    os.makedirs(ckpt_dir, exist_ok=True)
    by_rank = {}
    sdm, storage, planner = {}, {}, {}
    for key in sorted(chunks):
        shape, parts = chunks[key]
        dtype = parts[0][2].dtype
        cmeta = []
        for rank, off, t in parts:
            by_rank.setdefault(rank, []).append((key, tuple(off), t))
            cmeta.append(md.ChunkStorageMetadata(torch.Size(off), torch.Size(t.shape)))
        props = md.TensorProperties(dtype) if fake else md.TensorProperties(dtype=dtype)
        sdm[key] = md.TensorStorageMetadata(props, torch.Size(shape), cmeta)
        planner[key] = (key,)
    for rank, items in sorted(by_rank.items()):
        rel = "__%d_0.distcp" % rank
        with open(os.path.join(ckpt_dir, rel), "wb") as f:
            for key, off, t in items:
                buf = io.BytesIO()
                torch.save(t.detach().contiguous().clone(), buf)  # clone: a view would save its whole storage
                b = buf.getvalue()
                pos = f.tell()
                f.write(b)
                storage[md.MetadataIndex(key, torch.Size(off), None) if fake else
                        md.MetadataIndex(key, torch.Size(off))] = fs._StorageInfo(rel, pos, len(b))
    meta = md.Metadata(sdm, planner, storage) if fake else \
        md.Metadata(state_dict_metadata=sdm, planner_data=planner, storage_data=storage)
    saved = {}
    if fake:  # pickle looks the classes up by module name
        for name, mod in (("torch.distributed.checkpoint", types.ModuleType("torch.distributed.checkpoint")),
                          (MD_MOD, md), (FS_MOD, fs)):
            saved[name] = sys.modules.get(name)
            sys.modules[name] = mod
    try:
        with open(os.path.join(ckpt_dir, ".metadata"), "wb") as f:
            pickle.dump(meta, f)
    finally:
        for name, mod in saved.items():
            if mod is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = mod
