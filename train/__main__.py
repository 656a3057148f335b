from train.cli import train

train()
