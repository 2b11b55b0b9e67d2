"""BLEU and ROUGE of generated text against references, through the field's own scorers.

BLEU (Papineni et al. 2002) is corpus-level: n-gram precisions for n = 1..4 pooled over all
predictions, their geometric mean times a brevity penalty, 0–100, as
`sacrebleu.corpus_bleu(predictions, [references])` computes it with its default "13a"
tokenisation (Post 2018, "A Call for Clarity in Reporting BLEU Scores": scores from
different tokenisations are not comparable, so the reference implementation is used, not a
re-implementation). ROUGE-1/2/L (Lin 2004) is per pair: unigram and bigram overlap and the
longest common subsequence, as F1 of precision and recall, 0–1; the reported score is the
mean F1 over pairs, from `rouge_score.rouge_scorer.RougeScorer([...], use_stemmer=True)`
(Porter stemming, as the ROUGE-1.5.5 perl script's -m option).

Both packages are optional (`pip install 'fivefold[eval]'`) and imported only when a score
is asked for; a missing one is named in one line.
"""

from __future__ import annotations

from collections.abc import Sequence

from fivefold.config import ConfigError
from fivefold.extras import require

ROUGE_TYPES = ("rouge1", "rouge2", "rougeL")


def _check(predictions: Sequence[str], references: Sequence[str]) -> None:
    if len(predictions) != len(references):
        raise ConfigError(f"{len(predictions)} predictions but {len(references)} references; "
                          f"give one reference per prediction")
    if not predictions:
        raise ConfigError("no predictions to score; give a file with at least one line")


def bleu(predictions: Sequence[str], references: Sequence[str]) -> float:
    """Corpus BLEU, 0–100, one reference per prediction."""
    _check(predictions, references)
    sacrebleu = require("sacrebleu", "eval", "BLEU")
    return float(sacrebleu.corpus_bleu(list(predictions), [list(references)]).score)


def rouge(predictions: Sequence[str], references: Sequence[str]) -> dict[str, float]:
    """Mean F1 of ROUGE-1, ROUGE-2 and ROUGE-L over the pairs, each 0–1."""
    _check(predictions, references)
    rouge_scorer = require("rouge_score.rouge_scorer", "eval", "ROUGE")
    scorer = rouge_scorer.RougeScorer(list(ROUGE_TYPES), use_stemmer=True)
    sums = dict.fromkeys(ROUGE_TYPES, 0.0)
    for prediction, reference in zip(predictions, references):
        scores = scorer.score(reference, prediction)  # (target, prediction)
        for kind in ROUGE_TYPES:
            sums[kind] += scores[kind].fmeasure
    return {kind: total / len(predictions) for kind, total in sums.items()}


def text_scores(predictions: Sequence[str], references: Sequence[str]) -> dict[str, float]:
    """{"bleu", "rouge1", "rouge2", "rougeL", "examples"} for the pairs."""
    return {"bleu": bleu(predictions, references), **rouge(predictions, references),
            "examples": len(predictions)}
