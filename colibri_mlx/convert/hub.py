"""`--repo`: download one shard, convert it, delete it, next (disk-safe, resumable).

Peak disk use is one source shard plus the growing output. Downloads go through
`huggingface_hub.hf_hub_download` (its own resume, token and endpoint handling) into
`<outdir>/_inflight`; a shard is deleted as soon as its output is recorded.
"""

from __future__ import annotations

import os
import shutil
from typing import Optional

from .classify import ConvertError
from .pipeline import read_weight_map

INFLIGHT = "_inflight"
META = "_meta"
INDEX_FILE = "model.safetensors.index.json"


def free_gb(path: str) -> float:
    # The output directory is created only once the plan is validated: ask its nearest ancestor.
    path = os.path.abspath(path)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return shutil.disk_usage(path).free / 1e9


def require_free(path: str, min_free_gb: float, starting: bool):
    free = free_gb(path)
    if free < min_free_gb:
        what = "refusing to start" if starting else "stopping"
        raise ConvertError(f"{path}: {free:.1f} GB free is below --min-free-gb {min_free_gb:g}; {what}. "
                           "Free some space (or lower --min-free-gb) and rerun to resume.")


def _hub_error(repo: str, what: str, e: Exception) -> ConvertError:
    from huggingface_hub import constants
    from huggingface_hub.errors import GatedRepoError, OfflineModeIsEnabled, RepositoryNotFoundError

    if isinstance(e, OfflineModeIsEnabled) or constants.HF_HUB_OFFLINE:
        hint = "offline mode is on (HF_HUB_OFFLINE=1); --repo needs the network — unset it, or download " \
               "the checkpoint elsewhere and use --indir"
    elif isinstance(e, GatedRepoError):
        hint = "the repository is gated: accept its terms on the Hub and set HF_TOKEN"
    elif isinstance(e, RepositoryNotFoundError):
        hint = "no such repository (or it is private: set HF_TOKEN)"
    else:
        hint = f"the Hub at {constants.ENDPOINT} could not be reached; check the network, HF_ENDPOINT and proxy settings"
    return ConvertError(f"--repo {repo}: cannot {what}: {hint} ({type(e).__name__}: {e})")


class HubSource:
    """The files of one Hub repository, fetched one at a time into the output directory."""

    def __init__(self, repo: str, outdir: str, revision: Optional[str] = None):
        self.repo, self.outdir, self.revision = repo, outdir, revision
        self.inflight = os.path.join(outdir, INFLIGHT)
        self.sizes = self._list_files()

    def _list_files(self) -> dict[str, Optional[int]]:
        from huggingface_hub import HfApi

        try:
            info = HfApi().model_info(self.repo, revision=self.revision, files_metadata=True)
        except Exception as e:  # network, auth and offline errors all end here with a hint
            raise _hub_error(self.repo, "list the repository's files", e) from e
        return {s.rfilename: s.size for s in (info.siblings or [])}

    @property
    def shards(self) -> list[str]:
        names = sorted(f for f in self.sizes if f.endswith(".safetensors") and "/" not in f)
        if not names:
            raise ConvertError(f"--repo {self.repo}: no .safetensors shards at the repository's top level")
        return names

    def download(self, filename: str, dest: str) -> str:
        from huggingface_hub import hf_hub_download

        try:
            return hf_hub_download(self.repo, filename, revision=self.revision, local_dir=dest)
        except Exception as e:
            raise _hub_error(self.repo, f"download {filename}", e) from e

    def fetch_shard(self, filename: str) -> str:
        return self.download(filename, self.inflight)

    def release(self, path: str):
        """Delete the converted shard and hf_hub_download's bookkeeping for it."""
        if os.path.exists(path):
            os.unlink(path)
        shutil.rmtree(os.path.join(self.inflight, ".cache"), ignore_errors=True)

    def fetch_metadata(self, names: list[str], dest: str):
        """Download the small metadata files that exist into `dest` (a planning directory
        outside the output: the output is not touched before the plan is validated)."""
        for name in names:
            if name in self.sizes:
                self.download(name, dest)

    def weight_map(self, dest: str) -> Optional[dict]:
        if INDEX_FILE not in self.sizes:
            return None
        return read_weight_map(self.download(INDEX_FILE, dest))

    def cleanup(self):
        shutil.rmtree(self.inflight, ignore_errors=True)
        shutil.rmtree(os.path.join(self.outdir, META), ignore_errors=True)  # left by earlier versions
