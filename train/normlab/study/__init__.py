"""The study over trained and pretrained models: the angles command, the centring ablation and the report that turns
runs into tables, figures and a verdict."""
