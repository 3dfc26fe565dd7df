"""A chat or completion request's `response_format` (OpenAI's forms) checked into the grammar its
answer follows (constraints.py): {"type": "text"} none, {"type": "json_object"} any JSON object,
{"type": "json_schema", "json_schema": {"name", "schema", "strict"?, "description"?}} the JSON
texts the schema accepts. A form that is not one of these raises FormatError (the server's 400)."""
import re

from .. import constraints

NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for a schema's and a function's name


class FormatError(ValueError):
    """A field at fault: the message says what is wrong, param names the field."""

    def __init__(self, message, param):
        super().__init__(message)
        self.param = param


def schema_grammar(schema, where, param):
    """The grammar of a JSON schema given at `where` (for the message), or a FormatError."""
    if not isinstance(schema, dict):
        raise FormatError(f"{where} must be a JSON schema (an object)", param)
    try:
        grammar = constraints.schema_grammar(schema)
        error = constraints.check(grammar)
    except ValueError as e:
        error = str(e)
    if error:
        raise FormatError(f"{where} is not a JSON schema this server takes: {error}", param)
    return grammar


def response_format(body):
    """The grammar a request's response_format asks for (None: free text)."""
    rf = body.get("response_format")
    if rf is None:
        return None
    where = "response_format"
    if not isinstance(rf, dict) or not isinstance(rf.get("type"), str):
        raise FormatError("'response_format' must be an object with a 'type': 'text', "
                          "'json_object' or 'json_schema'", where)
    kind = rf["type"]
    known = {"text": {"type"}, "json_object": {"type"}, "json_schema": {"type", "json_schema"}}
    if kind not in known:
        raise FormatError(f"'response_format' type '{kind}' is not supported (only 'text', "
                          "'json_object' and 'json_schema')", where)
    if extra := sorted(set(rf) - known[kind]):
        raise FormatError(f"'response_format' of type '{kind}' takes no '{extra[0]}'", where)
    if kind == "text":
        return None
    if kind == "json_object":
        return constraints.JSON_OBJECT
    spec = rf.get("json_schema")
    if not isinstance(spec, dict):
        raise FormatError("'response_format.json_schema' must be an object with a 'name' and a "
                          "'schema'", where)
    if extra := sorted(set(spec) - {"name", "schema", "strict", "description"}):
        raise FormatError(f"'response_format.json_schema' takes no '{extra[0]}'", where)
    if not isinstance(spec.get("name"), str) or not NAME.match(spec["name"]):
        raise FormatError("'response_format.json_schema.name' must be 1 to 64 letters, digits, "
                          "'_' or '-'", where)
    if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
        raise FormatError("'response_format.json_schema.strict' must be true or false", where)
    if "schema" not in spec:  # OpenAI's default: any JSON object
        return constraints.JSON_OBJECT
    return schema_grammar(spec["schema"], "'response_format.json_schema.schema'", where)
