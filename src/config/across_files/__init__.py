"""Settings that span the three files of a run: the table of shared keys, values one file derives from
another, and the checks across them."""
