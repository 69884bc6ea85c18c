"""The names --tool-call-parser takes, declared once: "auto" and one per syntax of gateway.text.tool_syntax
(which checks that its syntaxes are these). Its own module so the options import it without the
syntaxes' parsers and Jinja: `tokenmill serve --help` and every other command read the choices from here."""

TOOL_CALL_PARSERS = ("auto", "hermes", "llama3_json")
