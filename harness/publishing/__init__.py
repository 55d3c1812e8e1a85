"""What a run shows and where it came from: the tables it prints (tables), its figure (plots), its provenance and
environment (provenance), and the Rosetta site (site) with the published runs it shows (published)."""
