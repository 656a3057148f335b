"""Pretrained models: the angles CSVs of normlab-angles (rows at step 0) and the ablation CSVs of normlab-ablate of
models the report did not train, one model per run and norm of their identity columns."""

from dataclasses import dataclass, field, replace
from pathlib import Path

from normlab.probe.table import AnalysisError
from normlab.study.report.groups import Series, slug
from normlab.study.report.runs import read_ablation, read_angles


@dataclass(frozen=True)
class Pretrained:
    """A pretrained model of an angles CSV of normlab-angles (rows at step 0), with its ablation rows if given."""
    name: str
    norm: str  # "" where the CSV does not say
    csv: Path
    angles: list[dict]
    ablation: list[dict] = field(default_factory=list)

    @property
    def slug(self) -> str:
        return slug(f"pretrained-{self.name}")

    def series(self) -> list[Series]:
        return [Series(self.norm or "norm not recorded", [self.angles], [self.ablation], [self.name])]


def csv_kind(path: Path) -> str:
    header = path.open(encoding="utf-8", errors="replace").readline().strip().split(",")
    if "mean_deg" in header:
        return "angles"
    if "delta" in header and "site" in header:
        return "ablation"
    raise AnalysisError(f"{path} is neither an angles CSV (normlab-angles) nor an ablation CSV (normlab-ablate): "
                        "give the CSVs those commands write")


def load_pretrained(paths: list[Path]) -> list[Pretrained]:
    """The models of the angles CSVs in `paths`, one per (run, norm) of their identity columns (normlab-angles
    names a Hugging Face model's run after its directory, its model after its type; the file's name where the CSV
    has neither); the rows of ablation CSVs join the model their `run` (or `model`) names."""
    models: dict[tuple, Pretrained] = {}
    ablations: list[dict] = []
    for path in paths:
        if not path.is_file():
            raise AnalysisError(f"{path} does not exist: give the CSV files of normlab-angles or normlab-ablate")
        if csv_kind(path) == "ablation":
            ablations += read_ablation(path)
            continue
        for row in read_angles(path, f"regenerate it with normlab-angles model_path=<the model> out={path}"):
            name, norm = row.get("run") or row.get("model") or path.stem, row.get("norm") or ""
            models.setdefault((name, norm), Pretrained(name, norm, path, [])).angles.append(row)
    return sorted((replace(model, ablation=[r for r in ablations if model.name in (r.get("run"), r.get("model"))])
                   for model in models.values()), key=lambda m: m.name)

