"""Helpers shared by convert.py and export.py: one-line refusals, logging, torch import, pickled
.pt files and a self-contained safetensors reader/writer (the `safetensors` package may be absent)."""

import json
import os
import struct
import sys


class Refusal(Exception):
    """A checkpoint or option this tool does not handle; main() prints it as one line."""


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def need_torch():
    try:
        import torch  # noqa: F401  (is it importable)
    except ImportError:
        raise Refusal("PyTorch is required to read Megatron checkpoints (pip install torch, or apt-get install "
                      "python3-torch)")
    return sys.modules["torch"]


def run_main(prog, fn):
    """Runs fn(); a Refusal or any other failure becomes one line on stderr and a nonzero exit.
    KRAIT_MEGATRON_DEBUG=1 keeps the traceback of unexpected failures."""
    try:
        fn()
    except Refusal as e:
        print("%s: error: %s" % (prog, e), file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        sys.exit(130)
    except Exception as e:  # a bug or an unreadable file: still one line unless debugging
        if os.environ.get("KRAIT_MEGATRON_DEBUG"):
            raise
        print("%s: error: %s: %s (KRAIT_MEGATRON_DEBUG=1 shows where)" % (prog, type(e).__name__, e),
              file=sys.stderr)
        sys.exit(1)


def load_pt(path):
    """torch.load of a Megatron file (args is an argparse.Namespace: needs weights_only=False, which
    torch >= 2.6 no longer defaults to). Only convert checkpoints you trust: this unpickles."""
    torch = need_torch()
    try:
        return torch.load(path, map_location="cpu", weights_only=False)
    except TypeError:  # torch < 1.13 has no weights_only
        return torch.load(path, map_location="cpu")


# ---- safetensors ------------------------------------------------------------------------------

_ST_DTYPES = {"BF16": 2, "F16": 2, "F32": 4, "F64": 8, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
              "BOOL": 1, "F8_E4M3": 1}


def _torch_st_names():
    torch = need_torch()
    return {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32", torch.float64: "F64",
            torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
            torch.bool: "BOOL"}


def tensor_bytes(t):
    """Raw little-endian bytes of a CPU tensor. bf16 goes through an int16 view: numpy has no bf16."""
    torch = need_torch()
    t = t.detach().contiguous().cpu()
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    return t.numpy().tobytes()


def st_header(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        return json.loads(f.read(n)), 8 + n


def st_read_raw(path):
    """{name: (dtype, shape, bytes)} without torch (for byte comparisons)."""
    hdr, base = st_header(path)
    out = {}
    with open(path, "rb") as f:
        for name, v in hdr.items():
            if name == "__metadata__":
                continue
            a, b = v["data_offsets"]
            f.seek(base + a)
            out[name] = (v["dtype"], tuple(v["shape"]), f.read(b - a))
    return out


def st_dir_files(d):
    idx = os.path.join(d, "model.safetensors.index.json")
    if os.path.exists(idx):
        with open(idx) as f:
            return sorted(set(os.path.join(d, x) for x in json.load(f)["weight_map"].values()))
    one = os.path.join(d, "model.safetensors")
    if os.path.exists(one):
        return [one]
    return sorted(os.path.join(d, x) for x in os.listdir(d) if x.endswith(".safetensors"))


def st_read_dir_raw(d):
    out = {}
    for p in st_dir_files(d):
        out.update(st_read_raw(p))
    return out


def st_read_dir_torch(d):
    """{name: torch tensor} of every *.safetensors of a checkpoint directory."""
    torch = need_torch()
    names = {v: k for k, v in _torch_st_names().items()}
    out = {}
    for name, (dt, shape, raw) in st_read_dir_raw(d).items():
        if dt not in names:
            raise Refusal("%s: tensor %s has dtype %s, which this tool does not read" % (d, name, dt))
        tdt = names[dt]
        if tdt == torch.bfloat16:
            t = torch.frombuffer(bytearray(raw), dtype=torch.int16).view(torch.bfloat16) if raw else \
                torch.empty(0, dtype=tdt)
        else:
            t = torch.frombuffer(bytearray(raw), dtype=tdt) if raw else torch.empty(0, dtype=tdt)
        out[name] = t.reshape(shape)
    return out


def st_write(path, tensors):
    """Writes {name: tensor} as one safetensors file, names sorted; the header is padded with
    spaces to a multiple of 8 bytes so every tensor starts aligned (as the reference writer does)."""
    names = _torch_st_names()
    hdr, off = {"__metadata__": {"format": "pt"}}, 0
    order = sorted(tensors)
    for k in order:
        t = tensors[k]
        if t.dtype not in names:
            raise Refusal("tensor %s has dtype %s, which safetensors output does not take" % (k, t.dtype))
        n = t.numel() * t.element_size()
        hdr[k] = {"dtype": names[t.dtype], "shape": list(t.shape), "data_offsets": [off, off + n]}
        off += n
    h = json.dumps(hdr, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for k in order:
            f.write(tensor_bytes(tensors[k]))
    os.replace(tmp, path)


def st_write_dir(d, tensors, max_shard_bytes):
    """model.safetensors, or model-XXXXX-of-YYYYY.safetensors + index when over max_shard_bytes."""
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    if total <= max_shard_bytes:
        st_write(os.path.join(d, "model.safetensors"), tensors)
        return ["model.safetensors"]
    shards, cur, size = [], {}, 0
    for k in sorted(tensors):
        n = tensors[k].numel() * tensors[k].element_size()
        if cur and size + n > max_shard_bytes:
            shards.append(cur)
            cur, size = {}, 0
        cur[k] = tensors[k]
        size += n
    shards.append(cur)
    wmap, files = {}, []
    for i, s in enumerate(shards):
        fn = "model-%05d-of-%05d.safetensors" % (i + 1, len(shards))
        st_write(os.path.join(d, fn), s)
        files.append(fn)
        for k in s:
            wmap[k] = fn
    with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": wmap}, f, indent=2, sort_keys=True)
    return files
