"""The datasets and what their files say (no torch here, so the command-line check can read shapes and files
before torch is imported): datasets.py builds them by name (build_dataset), shapes.py reads channels, size and
classes from their files, fashion_mnist_files.py finds Fashion-MNIST's idx files; one module per dataset."""
