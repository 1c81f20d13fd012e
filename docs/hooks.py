"""MkDocs hook: the configuration reference page, generated when the site is built.

`on_files` adds reference/configuration.md, written by looprl/config/reference.py from
the config schema, so the page always matches the code and nothing generated is checked
in. mkdocs.yml names this file under `hooks:` and keeps it out of the site.
"""

from mkdocs.structure.files import File

from looprl.config.reference import markdown


def on_files(files, config):
    files.append(File.generated(config, "reference/configuration.md", content=markdown()))
    return files
