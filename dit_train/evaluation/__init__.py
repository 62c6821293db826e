"""What a run measures besides its training loss: validation loss, sample grids and the FD."""
