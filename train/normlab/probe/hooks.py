"""The hooks that measure: forward hooks on the norm sites reduce each norm's input (h for the attention norm, h + a
for the MLP norm, the last residual stream for the final norm) and its output after the affine map at once to
statistics (probe.stats), and `measure` runs a model's forward over batches with them on. References: the uniform
vector 1, a random vector a~ with the same norm sqrt(d) and a random vector b~ with another norm (fixed seeds). Rows
at site "<norm>.rotation" hold the angle between each norm's input and output. Position "all" counts every token,
"first" only the first token of each document (the one after a document separator: GPT-2's EOT, or the model's EOS,
which a BOS then follows), "rest" all but those.
"""

from contextlib import contextmanager

import torch

from normlab.probe.sites import NormSite, site_rows, stat_rows
from normlab.probe.stats import AngleStats
from normlab.probe.table import POSITIONS

NULL_DIRECTIONS_SEED = 3  # the random directions of the percentile null (1, 2: a~ and b~)


def reference_vectors(d: int, seed_a: int = 1, seed_b: int = 2, norm_b: float = 0.5) -> torch.Tensor:
    """[3, d]: the uniform vector 1 (norm sqrt d), a~ of norm sqrt(d) and b~ of norm norm_b * sqrt(d)."""
    gen_a, gen_b = torch.Generator().manual_seed(seed_a), torch.Generator().manual_seed(seed_b)
    a, b = torch.randn(d, generator=gen_a, dtype=torch.float64), torch.randn(d, generator=gen_b, dtype=torch.float64)
    return torch.stack([torch.ones(d, dtype=torch.float64), a / a.norm() * d**0.5, b / b.norm() * norm_b * d**0.5])


def random_directions(count: int, d: int) -> torch.Tensor:
    """[count, d]: unit vectors drawn uniformly on the sphere (normalised Gaussians), the same for every run."""
    directions = torch.randn(count, d, generator=torch.Generator().manual_seed(NULL_DIRECTIONS_SEED),
                             dtype=torch.float64)
    return directions / directions.norm(dim=1, keepdim=True)


class AngleProbe:
    """Forward hooks on the norm modules that feed AngleStats. A hook reduces the norm's input and output to a
    few numbers per token (their norms, their dot products with the references, the rotation); `flush()`, after
    each forward, turns those of every site into angles and statistics at once. `mask` ([B, T] bool, True = real
    token) must be set before each forward when batches are padded."""

    def __init__(self, sites: list[NormSite], d: int, device=None, null_directions: int = 0, **reference_kwargs):
        self.sites, self.d = sites, d
        self.stats = AngleStats(stat_rows(sites), d, device, null_directions)
        self.references = reference_vectors(d, **reference_kwargs).to(device=device, dtype=torch.float32)
        self.reference_norms = self.references.norm(dim=1)
        # float64: the null's angles, summed over every token, must not depend on which float32 kernel a process
        # happens to run (seen: the first call of a process, now and then, 1e-7 degree off the others)
        self.random_directions = random_directions(null_directions, d).to(device=device, dtype=torch.float64)
        self.mask: torch.Tensor | None = None
        self.first: torch.Tensor | None = None  # [B, T] bool: the first tokens of documents (None: position 0)
        self._pending: list[tuple[NormSite, torch.Tensor, torch.Tensor | None]] = []
        self._row_cache: dict[tuple, torch.Tensor] = {}

    @contextmanager
    def hooks(self):
        handles = [s.module.register_forward_hook(self._hook(s)) for s in self.sites]
        try:
            yield self
        finally:
            for handle in handles:
                handle.remove()

    def _hook(self, site: NormSite):
        def hook(module, args, output):
            x = args[0] if args else None
            y = output[0] if isinstance(output, tuple) else output
            if any(pending is site for pending, *_ in self._pending):  # a norm called twice in one forward
                self.flush()
            with torch.autocast(x.device.type, enabled=False):  # float32 whatever the run's autocast
                x, y = x.detach().float(), y.detach().float()
                null = self._null_sums(x, y) if len(self.random_directions) else None
                self._pending.append((site, self._per_token(x, y), null))

        return hook

    def _positions(self, shape, device) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, T] masks of the tokens counted at positions all and first (rest: all but first)."""
        mask = self.mask if self.mask is not None else torch.ones(shape, dtype=torch.bool, device=device)
        first = self.first
        if first is None:
            first = torch.zeros(shape, dtype=torch.bool, device=device)
            first[:, 0] = True
        return mask, mask & first

    def _null_sums(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """[2 (angles, cos^2), 2 (input, output), 3 (POSITIONS), directions]: the sums of the angles of x and y to
        each random direction and of their cos^2, reduced at once (a [B, T, directions] tensor per norm would not
        fit for long)."""
        every_token, first_tokens = self._positions(x.shape[:2], x.device)

        def by_position(values: torch.Tensor) -> torch.Tensor:
            every, first = values[every_token].sum(0), values[first_tokens].sum(0)
            return torch.stack([every, first, every - first])

        angle_sums, cos2_sums = [], []
        for v in (x.double(), y.double()):
            cos = (v @ self.random_directions.T).div_(v.norm(dim=-1, keepdim=True).clamp_min(1e-30)).clamp_(-1, 1)
            cos2_sums.append(by_position(cos.square()))
            angle_sums.append(by_position(torch.rad2deg_(torch.acos_(cos))))
        return torch.stack([torch.stack(angle_sums), torch.stack(cos2_sums)])

    def _per_token(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """[B, T, 9]: x and y against each reference (dot products), |x|, |y|, and |x^ - y^| (unit vectors)."""
        x_norm, y_norm = x.norm(dim=-1, keepdim=True), y.norm(dim=-1, keepdim=True)
        # The rotation is small, so it is measured from |x^ - y^| (see flush), which keeps the precision that
        # an angle from x . y loses near 0.
        gap = torch.addcmul(x / x_norm.clamp_min(1e-30), y, -1 / y_norm.clamp_min(1e-30)).norm(dim=-1, keepdim=True)
        return torch.cat([x @ self.references.T, y @ self.references.T, x_norm, y_norm, gap], -1)

    def flush(self) -> None:
        """Add what the hooks saw since the last flush to the statistics: one update per position for all sites."""
        with torch.autocast(self.references.device.type, enabled=False):
            self._flush()

    def _flush(self) -> None:
        pending, self._pending = self._pending, []
        by_shape: dict[tuple, list] = {}
        for site, values, null in pending:
            by_shape.setdefault(values.shape, []).append((site, values))
            if null is not None:
                for position, angles, cos2 in zip(POSITIONS, null[0].unbind(1), null[1].unbind(1)):
                    # input rows get the input's sums, output rows the output's
                    self.stats.update_null(self._rows(site, position)[:6], angles.repeat_interleave(3, 0),
                                           cos2.repeat_interleave(3, 0))
        for group in by_shape.values():
            sites, values = zip(*group)
            values = torch.stack(values)  # [sites, B, T, 9]
            every_token, first_tokens = self._positions(values.shape[1:3], values.device)
            selections = (values[:, every_token], values[:, first_tokens], values[:, every_token & ~first_tokens])
            for position, selected in zip(POSITIONS, selections):
                self._update(sites, position, selected)

    def _update(self, sites, position: str, values: torch.Tensor) -> None:
        """values: [sites, tokens, 9] from _per_token."""
        dots, x_norm, y_norm, gap = values[..., :6], values[..., 6], values[..., 7], values[..., 8]
        norms = torch.stack([x_norm] * 3 + [y_norm] * 3 + [x_norm], 1)  # [sites, 7, tokens], in site_rows order
        cos = dots.transpose(1, 2) / (norms[:, :6] * self.reference_norms.repeat(2)[:, None]).clamp_min(1e-30)
        radians = torch.acos(cos.clamp(-1, 1))  # well conditioned: these angles lie near 90 degrees
        # for unit vectors |x^ + y^| = sqrt(4 - |x^ - y^|^2), and the angle between them is 2 atan2 of the two
        rotation = 2 * torch.atan2(gap, (4 - gap**2).clamp_min(0).sqrt())
        radians = torch.cat([radians, rotation[:, None]], 1)
        rows = torch.cat([self._rows(site, position) for site in sites])
        self.stats.update(
            rows, torch.rad2deg(radians).flatten(0, 1), norms.flatten(0, 1), (torch.cos(radians) ** 2).flatten(0, 1)
        )

    def _rows(self, site: NormSite, position: str) -> torch.Tensor:
        key = (site.layer, site.role, position)
        if key not in self._row_cache:
            rows = [self.stats.index[r] for r in site_rows(site, position)]
            self._row_cache[key] = torch.tensor(rows, device=self.references.device)
        return self._row_cache[key]


@torch.no_grad()
def measure(forward, sites: list[NormSite], d: int, batches, device=None, null_directions: int = 0,
            separator: int | None = None, **reference_kwargs) -> AngleStats:
    """Run `forward(ids, mask)` over `batches` of (ids, mask or None) with the hooks on; return the stats
    (merged over DDP ranks when a process group is initialised). Position first: the tokens that follow the token
    id `separator` (None: position 0 of each sequence)."""
    probe = AngleProbe(sites, d, device, null_directions, **reference_kwargs)
    with probe.hooks():
        for ids, mask in batches:
            probe.mask = mask
            if separator is not None:
                probe.first = torch.zeros_like(ids, dtype=torch.bool)
                probe.first[:, 1:] = ids[:, :-1] == separator
            forward(ids, mask)
            probe.flush()
    return probe.stats.all_reduce()

