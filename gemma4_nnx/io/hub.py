"""Hugging Face Hub ids as checkpoints: `google/gemma-4-E2B-it` downloaded through `huggingface_hub`
and converted once into a local Orbax cache, which later loads read directly.

A checkpoint argument names a Hub model when it is not an existing local path and looks like
`owner/name`, optionally `owner/name@revision` (a branch, a tag or a commit; default `main`). Then
(`resolve`):

1. the revision is resolved to its commit: online by asking the Hub; offline (`HF_HUB_OFFLINE=1`), or
   with the Hub out of reach, from huggingface_hub's cache (its `refs/`) or from what this cache
   recorded when it last resolved the revision (so a cleared Hugging Face cache does not matter);
2. when `<cache>/<owner>--<name>/<commit>/<options>/` exists it is the checkpoint: nothing is
   downloaded or converted. `<options>` spells what `gemma4-convert` was given that changes what it
   writes: the stored dtype, the PLE table's storage, the quantization and its group;
3. otherwise the files a load needs (config, safetensors, tokenizer, chat template, generation and
   processor configs: `allow_patterns`, at the repository's top level only, so no `original/`,
   `.gguf` or `.pth` copies) come through `huggingface_hub.snapshot_download` (its cache, its offline
   mode, its token: `HF_TOKEN` or the login `hf auth login` stored), and `gemma4_nnx.io.convert.convert`
   writes the checkpoint there. The converter writes a temporary sibling and renames it into place, so
   a half-written checkpoint never carries the final name; a lock file keeps two processes from
   converting the same key at once (the second waits, then loads the first one's).

The cache folder (`cache_dir`): `--model-cache DIR`, else `$GEMMA4_MODEL_CACHE`, else the user's cache
folder (`$XDG_CACHE_HOME` or `~/.cache`) then `gemma4_nnx/models`. Deleting it, or one model's folder
in it, clears it; the next start converts again (from huggingface_hub's cache where that still holds
the files).

`huggingface_hub` is imported when an id is resolved, never on import.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
import time
import uuid
from pathlib import Path

#: The environment variable naming the cache folder (`--model-cache` overrides it).
CACHE_ENV = "GEMMA4_MODEL_CACHE"
#: What `convert` is given for a Hub id when a command or caller says nothing: its own defaults.
OPTION_DEFAULTS = {"dtype": "bfloat16", "ple": "int4", "quantize": "keep", "group": None}
#: Only the repository's top level is downloaded: `original/` (Meta-style copies), subfolders of
#: other tools' formats. (`snapshot_download`'s patterns are fnmatch, where `*` matches `/` too.)
IGNORE_PATTERNS = ("*/*",)

_REPO = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")
_COMMIT = re.compile(r"[0-9a-f]{40}")


def _fix_local(repo: str) -> str:
    return f"or download the model yourself (`hf download {repo} --local-dir DIR`) and pass that folder"


class HubError(ValueError):
    """A Hub id that cannot become a checkpoint: malformed, unknown, gated, not cached while offline,
    or without the files a load needs. The message names the fix."""


# ------------------------------------------------------------------------------------------ ids
def looks_like_id(name: str | os.PathLike) -> bool:
    """Whether a checkpoint argument is taken for a Hub id: it is not an existing local path and it
    has the form `owner/name[@revision]` (one `/`, not starting with `.`, `/` or `~`). Whether the id
    is well formed is `parse_id`'s to say, so a malformed one gets an error that names the form."""
    name = os.fspath(name)
    if not name or os.path.exists(name):
        return False
    repo = name.split("@", 1)[0]
    return repo.count("/") == 1 and not repo.startswith((".", "/", "~")) and "\\" not in repo


def parse_id(name: str) -> tuple[str, str | None]:
    """(repo id, revision or None) of `owner/name[@revision]`; HubError for a malformed one."""
    repo, at, revision = name.partition("@")
    if at and not revision.strip():
        raise HubError(
            f"{name!r}: nothing after '@'. Fix: write OWNER/NAME@REVISION (a branch, a tag or a commit), "
            "or leave '@' out for the main branch"
        )
    model = repo.partition("/")[2]
    if not _REPO.fullmatch(repo) or "--" in repo or ".." in repo or repo.endswith(".git") or len(model) > 96:
        raise HubError(
            f"{name!r} is not an existing local path, nor a valid Hugging Face Hub id (OWNER/NAME: letters, "
            "digits, '-', '_' and '.', no '--' or '..', at most 96 characters a name; optionally @REVISION). "
            "Fix: give a checkpoint directory that exists, or a Hub id such as google/gemma-4-E2B-it"
        )
    return repo, revision or None


# ------------------------------------------------------------------------------------------ the cache
def cache_dir(where: str | os.PathLike | None = None) -> Path:
    """The folder of converted Hub checkpoints: `where`, else `$GEMMA4_MODEL_CACHE`, else the user's
    cache folder (`$XDG_CACHE_HOME` or `~/.cache`) then `gemma4_nnx/models`."""
    where = where or os.environ.get(CACHE_ENV)
    if where:
        return Path(os.fspath(where)).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "gemma4_nnx" / "models"


def conversion_options(options=None, *, ple_host: bool = False) -> dict:
    """`options` (a mapping of `convert`'s dtype / ple / quantize / group; None values: the default)
    completed with `OPTION_DEFAULTS` and checked. `ple_host`: the load leaves the PLE table on the host,
    which needs it float, so its default storage becomes "none"."""
    given = {k: v for k, v in dict(options or {}).items() if v is not None}
    unknown = sorted(set(given) - set(OPTION_DEFAULTS))
    if unknown:
        raise ValueError(
            f"convert_options: unknown option(s) {unknown}; a Hub id's conversion takes {sorted(OPTION_DEFAULTS)} "
            "(gemma4_nnx.io.convert.convert's arguments of those names)"
        )
    out = {**OPTION_DEFAULTS, **({"ple": "none"} if ple_host else {}), **given}
    from gemma4_nnx.io.convert import _check_options

    _check_options(out["dtype"], out["ple"], out["quantize"], out["group"])
    return out


def options_key(options) -> str:
    """The cache folder name of a set of conversion options (complete: `conversion_options`'s)."""
    key = f"{options['dtype']}-ple_{options['ple']}-quantize_{options['quantize']}"
    return key if options["group"] is None else f"{key}-group_{options['group']}"


def _repo_folder(root: Path, repo: str) -> Path:
    return root / repo.replace("/", "--")


def _complete(path: Path) -> bool:
    from gemma4_nnx.io.checkpoint import METADATA_FILE

    return (path / METADATA_FILE).is_file()


def _remember(root: Path, repo: str, revision: str | None, commit: str) -> None:
    """Record which commit `revision` resolved to, for offline starts after huggingface_hub's cache is
    cleared (written whole, then renamed: a reader never sees half a hash)."""
    if revision is not None and _COMMIT.fullmatch(revision):
        return
    ref = _repo_folder(root, repo) / "refs" / (revision or "main")
    ref.parent.mkdir(parents=True, exist_ok=True)
    tmp = ref.with_name(f".{ref.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}")
    tmp.write_text(commit)
    os.replace(tmp, ref)


# ------------------------------------------------------------------------------------------ huggingface_hub
def allow_patterns() -> list[str]:
    """The files a load and a conversion read: config.json, the safetensors (and their index), and the
    files `gemma4-convert` copies beside the weights (tokenizer, chat template, generation and
    processor configs)."""
    from gemma4_nnx.io.convert import COPY_FILES

    return ["config.json", "*.safetensors", "*.safetensors.index.json", *COPY_FILES]


def _offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def _hub_cache() -> str:
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE


def _error(e: Exception, repo: str, revision: str | None) -> HubError | None:
    """The HubError, naming the fix, of an exception huggingface_hub raised; None for others."""
    from huggingface_hub import errors

    at = f"{repo}@{revision}" if revision else repo
    if isinstance(e, errors.GatedRepoError):
        return HubError(
            f"{repo} is gated on the Hugging Face Hub and {_token_state()}. Fix: accept its terms at "
            f"https://huggingface.co/{repo} with your account, then log in here (`hf auth login`, or "
            f"`huggingface-cli login` with older huggingface_hub) or set HF_TOKEN to a token of that account; "
            f"{_fix_local(repo)}"
        )
    if isinstance(e, errors.RepositoryNotFoundError):
        return HubError(
            f"{repo}: no such model on the Hugging Face Hub (or a private one {_token_state()} cannot see), "
            f"and no local path {at} exists. Fix: check the id (e.g. google/gemma-4-E2B-it); for a private "
            "model log in (`hf auth login`) or set HF_TOKEN; or give a checkpoint directory that exists"
        )
    if isinstance(e, errors.RevisionNotFoundError):
        return HubError(
            f"{at}: the Hub has no revision {revision!r} of {repo}. Fix: give a branch, a tag or a commit "
            f"of https://huggingface.co/{repo} after '@', or leave '@...' out for the main branch"
        )
    if isinstance(e, errors.LocalEntryNotFoundError):
        why = (
            "HF_HUB_OFFLINE=1 keeps downloads off"
            if _offline()
            else f"the Hub could not be reached ({str(e).splitlines()[0]})"
        )
        return HubError(
            f"{at}: not in the Hugging Face cache ({_hub_cache()}) and {why}. Fix: run once with network "
            f"access (HF_HUB_OFFLINE unset) to download it, {_fix_local(repo)}"
        )
    return None


def _token_state() -> str:
    try:
        from huggingface_hub import get_token

        return "the token in use is not allowed to read it" if get_token() else "no token was found"
    except ImportError:  # an older huggingface_hub
        return "no token allowed to read it was found"


def download(repo: str, revision: str | None = None) -> str:
    """The local snapshot folder of Hub model `repo` at `revision` (None: main) holding the files a
    conversion reads (`allow_patterns`), downloaded through huggingface_hub's cache (read from it
    alone when HF_HUB_OFFLINE is set). HubError naming the fix when it cannot be had, or lacks
    config.json or safetensors weights."""
    import huggingface_hub as hh

    try:
        folder = hh.snapshot_download(
            repo,
            revision=revision,
            allow_patterns=allow_patterns(),
            ignore_patterns=list(IGNORE_PATTERNS),
            local_files_only=_offline(),
        )
    except Exception as e:
        mapped = _error(e, repo, revision)
        if mapped is None:
            raise
        raise mapped from None
    missing = [what for what, ok in _needed(folder) if not ok]
    if missing:
        raise HubError(
            f"{repo}@{os.path.basename(folder)[:12]}: {' and '.join(missing)} missing from {folder}. Fix: "
            "an offline cache missing files: run once with network access (HF_HUB_OFFLINE unset) to complete "
            "it; a repository of another format (a .gguf file): download that file and pass it to "
            "gemma4-convert; a model that is not Gemma's safetensors cannot be loaded"
        )
    return folder


def _needed(folder: str) -> list[tuple[str, bool]]:
    names = os.listdir(folder)
    return [("config.json", "config.json" in names), ("*.safetensors", any(n.endswith(".safetensors") for n in names))]


def _commit(repo: str, revision: str | None, root: Path) -> str:
    """The commit `revision` of `repo` is at: asked of the Hub, or read from the caches when offline or
    when the Hub cannot be reached (module docstring)."""
    if revision is not None and _COMMIT.fullmatch(revision):
        return revision
    import huggingface_hub as hh

    unreachable = None
    if not _offline():
        try:
            return hh.HfApi().repo_info(repo, revision=revision).sha
        except Exception as e:  # not found / gated / no such revision: said; anything else: the caches
            mapped = _error(e, repo, revision)
            if mapped is not None:
                raise mapped from None
            unreachable = e
    rev = revision or "main"
    # huggingface_hub's cache layout (its guide "Manage the cache"): models--OWNER--NAME/refs/REV
    for ref in (
        Path(_hub_cache()) / f"models--{repo.replace('/', '--')}" / "refs" / rev,
        _repo_folder(root, repo) / "refs" / rev,
    ):
        if ref.is_file():
            return ref.read_text().strip()
    why = (
        "HF_HUB_OFFLINE=1 keeps downloads off"
        if unreachable is None
        else f"the Hub could not be reached ({type(unreachable).__name__}: {str(unreachable).splitlines()[0]})"
    )
    raise HubError(
        f"{repo}@{rev}: not in the Hugging Face cache ({_hub_cache()}) nor converted in {root}, and {why}. "
        f"Fix: run once with network access (HF_HUB_OFFLINE unset) to download it, {_fix_local(repo)}"
    )


# ------------------------------------------------------------------------------------------ resolve
def resolve(
    name: str | os.PathLike,
    options=None,
    *,
    cache: str | os.PathLike | None = None,
    ple_host: bool = False,
    verbose: bool = True,
) -> str:
    """The converted checkpoint directory of Hub id `name` (`owner/name[@revision]`), converting it
    first when the cache lacks it (module docstring). `options`: `convert`'s dtype / ple / quantize /
    group (`conversion_options`; default its own defaults; `ple_host`: a float PLE table);
    `cache`: the cache folder (`cache_dir`). `verbose`: say on stderr which folder is loaded (and
    that it is being converted). Raises HubError naming the fix."""
    name = os.fspath(name)
    repo, revision = parse_id(name)
    options = conversion_options(options, ple_host=ple_host)
    root = cache_dir(cache)
    commit = _commit(repo, revision, root)
    dst = _repo_folder(root, repo) / commit / options_key(options)
    if not _complete(dst):
        _convert(repo, commit, dst, options, verbose)
    elif verbose:
        print(f"gemma4_nnx: {repo}@{commit[:12]}: the converted copy {dst}", file=sys.stderr)
    _remember(root, repo, revision, commit)
    return str(dst)


def _convert(repo: str, commit: str, dst: Path, options: dict, verbose: bool) -> None:
    """Download `repo` at `commit` and convert it into `dst`, under a lock so that one process
    converts and the others wait for its result."""
    from filelock import FileLock

    from gemma4_nnx.io import convert

    dst.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(f"{dst}.lock"):
        if _complete(dst):  # converted by another process while this one waited
            return
        if dst.exists():  # not ours to keep: a folder without metadata.json is no checkpoint
            shutil.rmtree(dst)
        src = download(repo, commit)
        if verbose:
            print(f"gemma4_nnx: {repo}@{commit[:12]}: converting once into {dst}", file=sys.stderr)
        t0 = time.monotonic()
        convert.convert(src, dst, **options)
        if verbose:
            print(f"gemma4_nnx: {repo}@{commit[:12]}: converted in {time.monotonic() - t0:.1f}s", file=sys.stderr)


# ------------------------------------------------------------------------------------------ commands
def add_hub_flags(parser, *, conversion: bool = True) -> None:
    """`--model-cache` and (`conversion`) `--quantize` / `--ple`: how a command converts a Hub id given
    as its checkpoint (`checkpoint_arg` reads them back)."""
    parser.add_argument(
        "--model-cache",
        metavar="DIR",
        default=None,
        help=f"where a Hugging Face Hub id (OWNER/NAME[@REVISION]) is kept once converted (default ${CACHE_ENV}, "
        "else $XDG_CACHE_HOME or ~/.cache, then gemma4_nnx/models); delete a folder there to clear it",
    )
    if not conversion:
        return
    from gemma4_nnx.io.convert import PLE_MODES, QUANTIZE_MODES

    parser.add_argument(
        "--quantize",
        choices=QUANTIZE_MODES,
        default=None,
        help="a Hub id only: how it is converted (gemma4-convert --quantize; default keep: the released weights "
        "as they are); each choice is converted once and kept",
    )
    parser.add_argument(
        "--ple",
        choices=tuple(PLE_MODES),
        default=None,
        help="a Hub id only: the per-layer-embedding table's storage (gemma4-convert --ple; default int4, none "
        "with --ple-host)",
    )


def checkpoint_arg(args, dest: str = "checkpoint", options=None) -> str | None:
    """Make `args.<dest>` (a command's checkpoint argument) a local directory: a Hub id is resolved
    (`resolve`: downloaded and converted once) with `--quantize` / `--ple` / `--model-cache` over the
    command's own `options`; a local path stays as it is. Returns the Hub repo id (None for a local
    path). ValueError naming the flag or the fix."""
    name = getattr(args, dest)
    flags = {k: getattr(args, k) for k in ("quantize", "ple") if getattr(args, k, None) is not None}
    if not looks_like_id(name):
        if flags:
            raise ValueError(
                f"{' / '.join(f'--{k}' for k in flags)}: say how a Hugging Face Hub id is converted; {name} is a "
                f"local path. Fix: convert it with `gemma4-convert {name} DST "
                f"{' '.join(f'--{k} {v}' for k, v in flags.items())}` and pass DST, or leave the flag out"
            )
        return None
    setattr(
        args,
        dest,
        resolve(
            name,
            {**(options or {}), **flags},
            cache=getattr(args, "model_cache", None),
            ple_host=bool(getattr(args, "ple_host", False)),
        ),
    )
    return parse_id(name)[0]
