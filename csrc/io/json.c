/* Strict JSON parser; see json.h for the contract. Recursive descent whose
 * depth is capped, so hostile nesting fails cleanly instead of overflowing
 * the stack. Every bound is checked against the input length because the
 * input is a slice of a memory mapping with no terminator. */
#include "json.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct json_parser {
    const char *text;
    size_t len;
    size_t pos;
    mc_json_error *error;
} json_parser;

#if defined(__GNUC__)
__attribute__((format(printf, 3, 4)))
#endif
static int parse_fail(json_parser *p, size_t offset, const char *fmt, ...) {
    p->error->offset = offset;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(p->error->msg, sizeof p->error->msg, fmt, ap);
    va_end(ap);
    return -1;
}

static int parse_nomem(json_parser *p, size_t count, size_t each, const char *what) {
    p->error->out_of_memory = 1;
    p->error->nomem_count = count;
    p->error->nomem_each = each;
    return parse_fail(p, p->pos, "%s", what);
}

/* Describes the byte at pos for messages: a printable character is quoted,
 * anything else is shown in hex, the end of input is named as such. */
static const char *describe_byte(const json_parser *p, size_t pos, char buf[16]) {
    if (pos >= p->len)
        return "end of input";
    unsigned char c = (unsigned char)p->text[pos];
    if (c >= 0x20 && c < 0x7f)
        snprintf(buf, 16, "'%c'", c);
    else
        snprintf(buf, 16, "byte 0x%02x", c);
    return buf;
}

static void skip_whitespace(json_parser *p) {
    while (p->pos < p->len) {
        char c = p->text[p->pos];
        if (c != ' ' && c != '\t' && c != '\n' && c != '\r')
            break;
        p->pos++;
    }
}

static void free_value_contents(mc_json_value *value);

/* Arrays and objects are both lists: of values, or of members (a key and a
 * value). One parser and one freer serve both, told the kind. */
typedef struct json_list_kind {
    mc_json_type type; /* MC_JSON_ARRAY or MC_JSON_OBJECT */
    char close;        /* ']' or '}' */
    const char *name;  /* "array" or "object", for messages */
    size_t item_size;
    /* Parses one item at p->pos (depth: the item's value's); on failure
     * frees what it made. */
    int (*parse_item)(json_parser *p, void *item, int depth);
    void (*free_item)(void *item);
} json_list_kind;

static void free_array_item(void *item) { free_value_contents(item); }

static void free_object_member(void *item) {
    mc_json_member *m = item;
    free(m->key);
    free_value_contents(&m->value);
}

static void free_list(const json_list_kind *kind, void *items, size_t count) {
    for (size_t i = 0; i < count; i++)
        kind->free_item((char *)items + i * kind->item_size);
    free(items);
}

static const json_list_kind array_kind, object_kind;

/* The tree is at most MC_JSON_MAX_DEPTH deep, so this recursion is bounded. */
static void free_value_contents(mc_json_value *value) {
    switch (value->type) {
    case MC_JSON_STRING:
        free(value->u.string.chars);
        break;
    case MC_JSON_ARRAY:
        free_list(&array_kind, value->u.array.items, value->u.array.count);
        break;
    case MC_JSON_OBJECT:
        free_list(&object_kind, value->u.object.members, value->u.object.count);
        break;
    default:
        break;
    }
    memset(value, 0, sizeof *value);
}

void mc_json_free(mc_json_value *value) {
    if (value != NULL)
        free_value_contents(value);
}

static int hex_digit(char c) {
    if (c >= '0' && c <= '9')
        return c - '0';
    if (c >= 'a' && c <= 'f')
        return c - 'a' + 10;
    if (c >= 'A' && c <= 'F')
        return c - 'A' + 10;
    return -1;
}

/* Reads the 4 hex digits of a \u escape starting at pos (just after "\u"). */
static int read_hex4(json_parser *p, size_t pos, uint32_t *out) {
    if (p->len - pos < 4)
        return parse_fail(p, pos, "truncated \\u escape");
    uint32_t v = 0;
    for (int i = 0; i < 4; i++) {
        int d = hex_digit(p->text[pos + (size_t)i]);
        if (d < 0)
            return parse_fail(p, pos + (size_t)i, "invalid hex digit in \\u escape");
        v = v * 16 + (uint32_t)d;
    }
    *out = v;
    return 0;
}

static size_t encode_utf8(uint32_t cp, char *dst) {
    if (cp < 0x80) {
        dst[0] = (char)cp;
        return 1;
    }
    if (cp < 0x800) {
        dst[0] = (char)(0xC0 | (cp >> 6));
        dst[1] = (char)(0x80 | (cp & 0x3F));
        return 2;
    }
    if (cp < 0x10000) {
        dst[0] = (char)(0xE0 | (cp >> 12));
        dst[1] = (char)(0x80 | ((cp >> 6) & 0x3F));
        dst[2] = (char)(0x80 | (cp & 0x3F));
        return 3;
    }
    dst[0] = (char)(0xF0 | (cp >> 18));
    dst[1] = (char)(0x80 | ((cp >> 12) & 0x3F));
    dst[2] = (char)(0x80 | ((cp >> 6) & 0x3F));
    dst[3] = (char)(0x80 | (cp & 0x3F));
    return 4;
}

/* Parses a string at p->pos (which holds the opening quote) into a fresh
 * NUL-terminated buffer. Decoding never grows the text (every escape is at
 * least as long as the bytes it stands for), so the raw span bounds the
 * allocation. */
static int parse_string(json_parser *p, char **chars_out, size_t *len_out) {
    size_t open = p->pos;
    size_t start = open + 1;
    size_t end = start;
    /* Find the closing quote first so the buffer can be sized once. */
    while (1) {
        if (end >= p->len)
            return parse_fail(p, open, "unterminated string");
        unsigned char c = (unsigned char)p->text[end];
        if (c == '"')
            break;
        if (c < 0x20)
            return parse_fail(p, end, "control character 0x%02x inside a string must be escaped", c);
        end += (c == '\\') ? 2 : 1;
    }
    char *buf = malloc(end - start + 1);
    if (buf == NULL)
        return parse_nomem(p, end - start + 1, 1, "a decoded string");
    size_t n = 0;
    size_t i = start;
    while (i < end) {
        char c = p->text[i];
        if (c != '\\') {
            buf[n++] = c;
            i++;
            continue;
        }
        char e = p->text[i + 1];
        switch (e) {
        case '"': buf[n++] = '"'; i += 2; continue;
        case '\\': buf[n++] = '\\'; i += 2; continue;
        case '/': buf[n++] = '/'; i += 2; continue;
        case 'b': buf[n++] = '\b'; i += 2; continue;
        case 'f': buf[n++] = '\f'; i += 2; continue;
        case 'n': buf[n++] = '\n'; i += 2; continue;
        case 'r': buf[n++] = '\r'; i += 2; continue;
        case 't': buf[n++] = '\t'; i += 2; continue;
        case 'u': break;
        default: {
            char desc[16];
            free(buf);
            return parse_fail(p, i, "invalid escape '\\' followed by %s", describe_byte(p, i + 1, desc));
        }
        }
        /* The closing quote is not a hex digit, so four valid digits always
         * lie inside the string. */
        uint32_t cp;
        if (read_hex4(p, i + 2, &cp) < 0) {
            free(buf);
            return -1;
        }
        size_t escape_at = i;
        i += 6;
        if (cp >= 0xDC00 && cp <= 0xDFFF) {
            free(buf);
            return parse_fail(p, escape_at, "lone low surrogate \\u%04X", (unsigned)cp);
        }
        if (cp >= 0xD800 && cp <= 0xDBFF) {
            uint32_t low;
            if (i + 6 > end || p->text[i] != '\\' || p->text[i + 1] != 'u' ||
                read_hex4(p, i + 2, &low) < 0 || low < 0xDC00 || low > 0xDFFF) {
                free(buf);
                return parse_fail(p, escape_at, "high surrogate \\u%04X not followed by a low surrogate",
                                  (unsigned)cp);
            }
            cp = 0x10000 + ((cp - 0xD800) << 10) + (low - 0xDC00);
            i += 6;
        }
        n += encode_utf8(cp, buf + n);
    }
    buf[n] = '\0';
    p->pos = end + 1;
    *chars_out = buf;
    *len_out = n;
    return 0;
}

static int is_digit(char c) { return c >= '0' && c <= '9'; }

/* Checks the number grammar and keeps the lexeme:
 * -? (0 | [1-9][0-9]*) (. [0-9]+)? ([eE] [+-]? [0-9]+)? */
static int parse_number(json_parser *p, mc_json_value *out) {
    size_t start = p->pos;
    size_t i = start;
    if (i < p->len && p->text[i] == '-')
        i++;
    if (i >= p->len || !is_digit(p->text[i]))
        return parse_fail(p, start, "invalid number: expected a digit");
    if (p->text[i] == '0') {
        i++;
        if (i < p->len && is_digit(p->text[i]))
            return parse_fail(p, start, "invalid number: leading zero");
    } else {
        while (i < p->len && is_digit(p->text[i]))
            i++;
    }
    if (i < p->len && p->text[i] == '.') {
        i++;
        if (i >= p->len || !is_digit(p->text[i]))
            return parse_fail(p, i, "invalid number: expected a digit after '.'");
        while (i < p->len && is_digit(p->text[i]))
            i++;
    }
    if (i < p->len && (p->text[i] == 'e' || p->text[i] == 'E')) {
        i++;
        if (i < p->len && (p->text[i] == '+' || p->text[i] == '-'))
            i++;
        if (i >= p->len || !is_digit(p->text[i]))
            return parse_fail(p, i, "invalid number: expected a digit in the exponent");
        while (i < p->len && is_digit(p->text[i]))
            i++;
    }
    out->type = MC_JSON_NUMBER;
    out->u.number.text = p->text + start;
    out->u.number.len = i - start;
    p->pos = i;
    return 0;
}

static int parse_literal(json_parser *p, const char *word, mc_json_value *out, mc_json_type type,
                         int boolean) {
    size_t n = strlen(word);
    if (p->len - p->pos < n || memcmp(p->text + p->pos, word, n) != 0) {
        char desc[16];
        return parse_fail(p, p->pos, "unexpected %s, expected a JSON value", describe_byte(p, p->pos, desc));
    }
    out->type = type;
    out->u.boolean = boolean;
    p->pos += n;
    return 0;
}

static int parse_value(json_parser *p, mc_json_value *out, int depth);

/* Makes room for element `count` of a vector (`what`, for the message),
 * doubling its capacity with overflow checks: 0, or -1 with the parser's
 * out-of-memory error naming what and how many bytes. */
static int reserve_one(json_parser *p, void **items, size_t count, size_t *capacity, size_t item_size,
                       const char *what) {
    if (count < *capacity)
        return 0;
    size_t fresh = *capacity ? *capacity * 2 : 8;
    if (*capacity > SIZE_MAX / 2 || fresh > SIZE_MAX / item_size)
        return parse_nomem(p, *capacity > SIZE_MAX / 2 ? SIZE_MAX : fresh, item_size, what);
    void *moved = realloc(*items, fresh * item_size);
    if (moved == NULL)
        return parse_nomem(p, fresh, item_size, what);
    *items = moved;
    *capacity = fresh;
    return 0;
}

/* Arrays and objects share their punctuation. Right after the opening
 * bracket: 1 (the bracket `close` consumed) when the container is empty. */
static int container_closes(json_parser *p, char close) {
    skip_whitespace(p);
    if (p->pos < p->len && p->text[p->pos] == close) {
        p->pos++;
        return 1;
    }
    return 0;
}

/* After an element of an array or object (`what`): 1 when ',' follows
 * (another element comes), 0 when `close` does (the container ends), -1
 * with the error set otherwise; the separator is consumed. */
static int after_element(json_parser *p, char close, const char *what) {
    skip_whitespace(p);
    if (p->pos < p->len && p->text[p->pos] == ',') {
        p->pos++;
        return 1;
    }
    if (container_closes(p, close))
        return 0;
    char desc[16];
    return parse_fail(p, p->pos, "expected ',' or '%c' in %s, found %s", close, what,
                      describe_byte(p, p->pos, desc));
}

static int parse_array_item(json_parser *p, void *item, int depth) { return parse_value(p, item, depth); }

static int parse_object_member(json_parser *p, void *item, int depth) {
    mc_json_member *m = item;
    char desc[16];
    skip_whitespace(p);
    if (p->pos >= p->len || p->text[p->pos] != '"')
        return parse_fail(p, p->pos, "expected a string key in object, found %s", describe_byte(p, p->pos, desc));
    m->key_offset = p->pos;
    if (parse_string(p, &m->key, &m->key_len) < 0)
        return -1;
    skip_whitespace(p);
    if (p->pos >= p->len || p->text[p->pos] != ':') {
        parse_fail(p, p->pos, "expected ':' after object key, found %s", describe_byte(p, p->pos, desc));
        free(m->key);
        return -1;
    }
    p->pos++;
    if (parse_value(p, &m->value, depth) < 0) {
        free(m->key);
        return -1;
    }
    return 0;
}

static const json_list_kind array_kind = {MC_JSON_ARRAY, ']', "array", sizeof(mc_json_value), parse_array_item, free_array_item};
static const json_list_kind object_kind = {MC_JSON_OBJECT, '}', "object", sizeof(mc_json_member),
                                           parse_object_member, free_object_member};

/* An array or object, from its opening bracket at p->pos. */
static int parse_list(json_parser *p, const json_list_kind *kind, int depth, mc_json_value *out) {
    void *items = NULL;
    size_t count = 0, capacity = 0;
    p->pos++; /* the opening bracket */
    int more = !container_closes(p, kind->close);
    while (more) {
        if (reserve_one(p, &items, count, &capacity, kind->item_size,
                        kind->type == MC_JSON_ARRAY ? "an array's items" : "an object's members") < 0)
            goto fail;
        void *item = (char *)items + count * kind->item_size;
        memset(item, 0, kind->item_size);
        if (kind->parse_item(p, item, depth + 1) < 0)
            goto fail;
        count++;
        if ((more = after_element(p, kind->close, kind->name)) < 0)
            goto fail;
    }
    out->type = kind->type;
    if (kind->type == MC_JSON_ARRAY) {
        out->u.array.items = items;
        out->u.array.count = count;
    } else {
        out->u.object.members = items;
        out->u.object.count = count;
    }
    return 0;
fail:
    free_list(kind, items, count);
    return -1;
}

static int parse_value(json_parser *p, mc_json_value *out, int depth) {
    skip_whitespace(p);
    out->offset = p->pos;
    if (p->pos >= p->len)
        return parse_fail(p, p->pos, "unexpected end of input, expected a JSON value");
    char c = p->text[p->pos];
    if ((c == '[' || c == '{') && depth >= MC_JSON_MAX_DEPTH)
        return parse_fail(p, p->pos, "nesting deeper than %d levels", MC_JSON_MAX_DEPTH);
    switch (c) {
    case '{': return parse_list(p, &object_kind, depth, out);
    case '[': return parse_list(p, &array_kind, depth, out);
    case '"':
        if (parse_string(p, &out->u.string.chars, &out->u.string.len) < 0)
            return -1;
        out->type = MC_JSON_STRING;
        return 0;
    case 't': return parse_literal(p, "true", out, MC_JSON_BOOL, 1);
    case 'f': return parse_literal(p, "false", out, MC_JSON_BOOL, 0);
    case 'n': return parse_literal(p, "null", out, MC_JSON_NULL, 0);
    default:
        if (c == '-' || is_digit(c))
            return parse_number(p, out);
        char desc[16];
        return parse_fail(p, p->pos, "unexpected %s, expected a JSON value", describe_byte(p, p->pos, desc));
    }
}

int mc_json_parse(const char *text, size_t len, mc_json_value *out, mc_json_error *error) {
    json_parser p = {.text = text, .len = len, .pos = 0, .error = error};
    memset(error, 0, sizeof *error);
    memset(out, 0, sizeof *out);
    if (parse_value(&p, out, 0) < 0) {
        mc_json_free(out);
        return -1;
    }
    skip_whitespace(&p);
    if (p.pos != len) {
        char desc[16];
        parse_fail(&p, p.pos, "trailing %s after the JSON value", describe_byte(&p, p.pos, desc));
        mc_json_free(out);
        return -1;
    }
    return 0;
}

int mc_utf8_validate(const uint8_t *bytes, size_t len, size_t *bad_offset) {
    size_t i = 0;
    while (i < len) {
        uint8_t b = bytes[i];
        if (b < 0x80) {
            i++;
            continue;
        }
        size_t need;
        uint32_t cp, min;
        if (b >= 0xC2 && b <= 0xDF) {
            need = 1, cp = b & 0x1F, min = 0x80;
        } else if (b >= 0xE0 && b <= 0xEF) {
            need = 2, cp = b & 0x0F, min = 0x800;
        } else if (b >= 0xF0 && b <= 0xF4) {
            need = 3, cp = b & 0x07, min = 0x10000;
        } else {
            /* 0x80-0xBF stray continuation, 0xC0/0xC1 always overlong, 0xF5+ beyond U+10FFFF */
            *bad_offset = i;
            return -1;
        }
        if (len - i - 1 < need) {
            *bad_offset = i;
            return -1;
        }
        for (size_t k = 1; k <= need; k++) {
            uint8_t cont = bytes[i + k];
            if ((cont & 0xC0) != 0x80) {
                *bad_offset = i;
                return -1;
            }
            cp = (cp << 6) | (cont & 0x3F);
        }
        if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) {
            *bad_offset = i;
            return -1;
        }
        i += need + 1;
    }
    return 0;
}

/* An integer lexeme as sign and magnitude. The failures, in the order they
 * are tested: not a number, a fraction or exponent, a minus sign where
 * `allow_negative` is 0 (including "-0"), a magnitude past UINT64_MAX. */
static mc_json_int_result integer_magnitude(const mc_json_value *value, int allow_negative, int *negative,
                                            uint64_t *magnitude) {
    if (value == NULL || value->type != MC_JSON_NUMBER)
        return MC_JSON_INT_NOT_NUMBER;
    const char *s = value->u.number.text;
    size_t n = value->u.number.len;
    *negative = (n > 0 && s[0] == '-');
    if (*negative) {
        s++;
        n--;
    }
    for (size_t i = 0; i < n; i++)
        if (!is_digit(s[i]))
            return MC_JSON_INT_NOT_INTEGER;
    if (*negative && !allow_negative)
        return MC_JSON_INT_NEGATIVE;
    uint64_t v = 0;
    for (size_t i = 0; i < n; i++) {
        uint64_t d = (uint64_t)(s[i] - '0');
        if (v > (UINT64_MAX - d) / 10)
            return MC_JSON_INT_OVERFLOW;
        v = v * 10 + d;
    }
    *magnitude = v;
    return MC_JSON_INT_OK;
}

mc_json_int_result mc_json_u64(const mc_json_value *value, uint64_t *out) {
    int negative;
    return integer_magnitude(value, 0, &negative, out);
}

mc_json_int_result mc_json_i64(const mc_json_value *value, int64_t *out) {
    int negative;
    uint64_t magnitude;
    mc_json_int_result r = integer_magnitude(value, 1, &negative, &magnitude);
    if (r != MC_JSON_INT_OK)
        return r;
    if (negative) {
        if (magnitude > (uint64_t)INT64_MAX + 1)
            return MC_JSON_INT_OVERFLOW;
        /* -(2^63) is representable although +2^63 is not. */
        *out = magnitude == (uint64_t)INT64_MAX + 1 ? INT64_MIN : -(int64_t)magnitude;
    } else {
        if (magnitude > (uint64_t)INT64_MAX)
            return MC_JSON_INT_OVERFLOW;
        *out = (int64_t)magnitude;
    }
    return MC_JSON_INT_OK;
}

const char *mc_json_int_result_text(mc_json_int_result result) {
    switch (result) {
    case MC_JSON_INT_OK: return "is a valid integer";
    case MC_JSON_INT_NOT_NUMBER: return "is not a number";
    case MC_JSON_INT_NOT_INTEGER: return "has a fraction or exponent (an integer is required)";
    case MC_JSON_INT_NEGATIVE: return "is negative";
    case MC_JSON_INT_OVERFLOW: return "does not fit in 64 bits";
    }
    return "is invalid";
}

const char *mc_json_type_name(mc_json_type type) {
    switch (type) {
    case MC_JSON_NULL: return "null";
    case MC_JSON_BOOL: return "boolean";
    case MC_JSON_NUMBER: return "number";
    case MC_JSON_STRING: return "string";
    case MC_JSON_ARRAY: return "array";
    case MC_JSON_OBJECT: return "object";
    }
    return "unknown";
}

const mc_json_value *mc_json_object_get(const mc_json_value *object, const char *key) {
    if (object == NULL || object->type != MC_JSON_OBJECT)
        return NULL;
    for (size_t i = 0; i < object->u.object.count; i++) {
        const mc_json_member *m = &object->u.object.members[i];
        if (strlen(key) == m->key_len && memcmp(m->key, key, m->key_len) == 0)
            return &m->value;
    }
    return NULL;
}
