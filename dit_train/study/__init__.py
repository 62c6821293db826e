"""Studies: the grid runner (dit-study), its reports (dit-report, dit-paired-report) and publishing them with their
records (dit-publish-study)."""
