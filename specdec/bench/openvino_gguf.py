"""GGUF files OpenVINO GenAI can read, and the OpenVINO model folder a draft needs.

Runs inside the OpenVINO peer venv (openvino_worker.py loads it by path) and in specdec's tests, so
it imports nothing of specdec: `gguf` and numpy, `openvino_genai` only in `export_folder`.
OpenVINO's GGUF reader takes F32, F16, BF16, Q4_0, Q4_1, Q8_0, Q4_K and Q6_K tensors;
`requantize` rewrites every other quantized tensor (the 0.5B draft's Q5_0) as Q8_0, dequantized and
quantized again with gguf.quants (8 bits per weight holds what 5 bits held, less 8-bit rounding).
`draft_model()` takes an OpenVINO model folder, not a .gguf: `model_folder` makes one per source
file (name and size), once, in a temporary folder renamed into place.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import gguf
import numpy as np

Q = gguf.GGMLQuantizationType
READABLE = {Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.Q4_K, Q.Q6_K}  # gguf_utils/gguf.cpp's list
INTEGER = {Q.I8, Q.I16, Q.I32, Q.I64}  # not weights: left alone
OV_MODEL = "openvino_model.xml"


def unreadable_tensors(path: Path) -> dict[str, str]:
    """Tensor name -> type name of every tensor `requantize` would rewrite."""
    reader = gguf.GGUFReader(path)
    return {t.name: t.tensor_type.name for t in reader.tensors if _rewrite(t.tensor_type)}


def _rewrite(qtype: Q) -> bool:
    return qtype not in READABLE and qtype not in INTEGER


def requantize(src: Path, dst: Path) -> int:
    """Write `src` to `dst` with every tensor OpenVINO cannot read as Q8_0, metadata and the other
    tensors copied as they are; written under a temporary name, then renamed. Returns the number
    of tensors rewritten."""
    reader = gguf.GGUFReader(src)
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    tmp = dst.with_name(f".{dst.name}.tmp")
    writer = gguf.GGUFWriter(tmp, arch=arch, endianess=reader.endianess)
    try:
        _copy_metadata(reader, writer)
        tensors = [(t.name, _as_q8_0(t) if _rewrite(t.tensor_type) else (t.data, t.tensor_type))
                   for t in reader.tensors]
        for name, (data, qtype) in tensors:
            writer.add_tensor_info(name, data.shape, data.dtype, data.nbytes, raw_dtype=qtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for _, (data, _) in tensors:
            writer.write_tensor_data(data, tensor_endianess=reader.endianess)
        writer.close()
        os.replace(tmp, dst)
    finally:
        tmp.unlink(missing_ok=True)
    return sum(_rewrite(t.tensor_type) for t in reader.tensors)


def _copy_metadata(reader: gguf.GGUFReader, writer: gguf.GGUFWriter) -> None:
    """Every key as it is (gguf's own gguf_new_metadata.py does the same), but those GGUFWriter writes
    itself: the architecture and the GGUF.* header fields."""
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        kind = field.types[0]
        sub_type = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), kind, sub_type=sub_type)


def _as_q8_0(tensor) -> tuple[np.ndarray, Q]:
    weights = gguf.quants.dequantize(tensor.data, tensor.tensor_type)  # [rows, cols] float32
    return gguf.quants.quantize(weights.astype(np.float32), Q.Q8_0), Q.Q8_0  # [rows, cols / 32 * 34] bytes


def model_folder(gguf_path: Path, cache: Path, properties: dict) -> Path:
    """The OpenVINO model folder of `gguf_path` under `cache` (`<stem>-<size>/`), exported on first
    use; `properties` go to the pipeline that exports it (threads)."""
    src = Path(gguf_path)
    folder = cache / f"{src.stem}-{src.stat().st_size}"
    if (folder / OV_MODEL).exists():
        return folder
    cache.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=cache))
    try:
        staged = tmp / src.name
        if unreadable_tensors(src):
            requantize(src, staged)
        else:
            os.symlink(src.resolve(), staged)
        export_folder(staged, properties)
        staged.unlink()  # the folder holds the OpenVINO model now
        try:
            os.rename(tmp, folder)
        except OSError:  # another process got there first: keep its folder
            if not (folder / OV_MODEL).exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def export_folder(staged: Path, properties: dict) -> None:  # pragma: no cover - needs openvino_genai
    """Load `staged` (a .gguf) once with enable_save_ov_model: OpenVINO GenAI then writes
    openvino_model.xml/.bin and openvino_(de)tokenizer.xml/.bin beside it (gguf_modeling.cpp,
    tokenizer_impl.cpp)."""
    import openvino_genai
    pipe = openvino_genai.LLMPipeline(str(staged), "CPU", enable_save_ov_model=True, **properties)
    del pipe
    if not (staged.parent / OV_MODEL).exists():
        raise RuntimeError(f"OpenVINO GenAI wrote no {OV_MODEL} beside {staged}")
