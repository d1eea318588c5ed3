"""Task suites built offline from what ships in packages (see docs/references.md, "Offline materials and stack")."""
