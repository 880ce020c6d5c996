"""Text overlap between a reference output and a candidate output: ROUGE-L and BLEU.

Both compare surface text only; they know nothing about models or tokens. Conventions:
  - ROUGE-L is the F-measure of rouge-score (0..1). rouge-score's tokenizer keeps only [a-z0-9]
    runs, so Chinese/Japanese/Korean text would vanish; we split CJK characters into one token
    each and leave everything else to rouge-score's own tokenizer.
  - BLEU is sacrebleu's (0..100) with tokenize="zh": it splits Chinese characters and falls back
    to the standard 13a rules elsewhere (identical to 13a on text without Chinese), so one setting
    serves every prompt set. "flores200" would need a SentencePiece model download; "char" would
    turn English into character n-grams. effective_order=True so short identical texts score 100.
  - Two empty (or both untokenizable) texts count as a perfect match when they are equal;
    an empty text against a non-empty one scores 0.
"""
from __future__ import annotations

import re
from functools import lru_cache

# CJK ideographs (incl. extension A and compatibility), kana and Hangul syllables: one token each
_CJK = re.compile(r"([\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af\uf900-\ufaff])")


class _CjkAwareTokenizer:
    """rouge-score's default tokenization, plus one token per CJK character."""

    def tokenize(self, text: str) -> list[str]:
        from rouge_score import tokenize
        tokens: list[str] = []
        for piece in _CJK.split(text):
            if not piece:
                continue
            if _CJK.fullmatch(piece):
                tokens.append(piece)
            else:
                tokens.extend(tokenize.tokenize(piece, None))
        return tokens


@lru_cache(maxsize=1)
def _rouge_scorer():
    from rouge_score import rouge_scorer
    return rouge_scorer.RougeScorer(["rougeL"], tokenizer=_CjkAwareTokenizer())


@lru_cache(maxsize=1)
def _bleu_metric():
    from sacrebleu.metrics import BLEU
    return BLEU(tokenize="zh", effective_order=True)


def rouge_l(reference: str, candidate: str) -> float:
    """ROUGE-L F-measure of candidate against reference, in [0, 1]."""
    tok = _CjkAwareTokenizer()
    if not tok.tokenize(reference) and not tok.tokenize(candidate):
        return 1.0 if reference.strip() == candidate.strip() else 0.0
    return float(_rouge_scorer().score(reference, candidate)["rougeL"].fmeasure)


def bleu(references: list[str], candidates: list[str]) -> float:
    """Corpus BLEU (0..100) of candidates[i] against references[i].

    Raises:
        ValueError: the two lists differ in length, or are empty."""
    if len(references) != len(candidates) or not references:
        raise ValueError(f"bleu needs equally many references and candidates, got "
                         f"{len(references)} and {len(candidates)}")
    if all(r.strip() == c.strip() for r, c in zip(references, candidates)):
        return 100.0  # also covers all-empty input, where sacrebleu says 0
    return float(_bleu_metric().corpus_score(candidates, [references]).score)


def sentence_bleu(reference: str, candidate: str) -> float:
    """BLEU (0..100) of one candidate against one reference (per-prompt rows of the report)."""
    if reference.strip() == candidate.strip():
        return 100.0
    return float(_bleu_metric().sentence_score(candidate, [reference]).score)
