from normlab.cli import train

train()
