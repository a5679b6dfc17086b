/* A small strict JSON parser (RFC 8259) for safetensors headers.
 *
 * The input is a byte range that need not be NUL-terminated (it is usually
 * a slice of a memory mapping). The parser builds a tree in which strings
 * are decoded to NUL-terminated UTF-8 (their length is kept too, because
 * "\u0000" can put a NUL inside), and numbers keep their raw lexeme so the
 * caller decides how to read them (mc_json_u64 refuses fractions, exponents,
 * negatives and values beyond 64 bits). Object members stay in input order
 * and duplicate keys are kept: rejecting them is the caller's decision.
 *
 * Nesting is capped (MC_JSON_MAX_DEPTH), so the recursive descent cannot
 * exhaust the C stack on hostile input. */
#ifndef MC_JSON_H
#define MC_JSON_H

#include <stddef.h>
#include <stdint.h>

#define MC_JSON_MAX_DEPTH 64

typedef enum mc_json_type {
    MC_JSON_NULL,
    MC_JSON_BOOL,
    MC_JSON_NUMBER,
    MC_JSON_STRING,
    MC_JSON_ARRAY,
    MC_JSON_OBJECT
} mc_json_type;

typedef struct mc_json_value mc_json_value;
typedef struct mc_json_member mc_json_member;

struct mc_json_value {
    mc_json_type type;
    size_t offset; /* byte offset in the input where the value starts */
    union {
        int boolean;
        struct {
            const char *text; /* points into the input; valid while the input is */
            size_t len;
        } number;
        struct {
            char *chars; /* decoded, NUL-terminated */
            size_t len;  /* bytes, excluding the terminator */
        } string;
        struct {
            mc_json_value *items;
            size_t count;
        } array;
        struct {
            mc_json_member *members;
            size_t count;
        } object;
    } u;
};

struct mc_json_member {
    char *key; /* decoded, NUL-terminated */
    size_t key_len;
    size_t key_offset; /* byte offset of the key's opening quote */
    mc_json_value value;
};

/* Why a parse failed and where (byte offset into the input). Out of memory:
 * out_of_memory is set, msg names what could not be allocated ("an array's
 * items") and nomem_count * nomem_each is its size (the product may
 * overflow: that is why it failed), for the caller's mc_fail_nomem_n. */
typedef struct mc_json_error {
    size_t offset;
    int out_of_memory;
    size_t nomem_count, nomem_each;
    char msg[160];
} mc_json_error;

/* Parses exactly one JSON value surrounded by optional whitespace; anything
 * else after it is an error. The input must already be valid UTF-8 (see
 * mc_utf8_validate); the parser checks the JSON grammar only. On success
 * *out is filled and must be released with mc_json_free; returns 0. On
 * failure returns -1, fills *error and leaves *out empty. */
int mc_json_parse(const char *text, size_t len, mc_json_value *out, mc_json_error *error);
void mc_json_free(mc_json_value *value);

/* Checks UTF-8 well-formedness (no overlong forms, no surrogates, nothing
 * above U+10FFFF, no truncated sequences). Returns 0, or -1 and the offset
 * of the first bad byte in *bad_offset. */
int mc_utf8_validate(const uint8_t *bytes, size_t len, size_t *bad_offset);

typedef enum mc_json_int_result {
    MC_JSON_INT_OK = 0,
    MC_JSON_INT_NOT_NUMBER,   /* the value is not a number at all */
    MC_JSON_INT_NOT_INTEGER,  /* it has a fraction or an exponent */
    MC_JSON_INT_NEGATIVE,     /* a minus sign, including "-0" (mc_json_u64 only) */
    MC_JSON_INT_OVERFLOW      /* more than fits in the target type */
} mc_json_int_result;

/* Reads a non-negative integer written without fraction or exponent. */
mc_json_int_result mc_json_u64(const mc_json_value *value, uint64_t *out);
/* Reads a signed integer written without fraction or exponent. */
mc_json_int_result mc_json_i64(const mc_json_value *value, int64_t *out);
/* A short phrase for a result, e.g. "has a fraction or exponent". */
const char *mc_json_int_result_text(mc_json_int_result result);
/* "null", "boolean", "number", "string", "array" or "object". */
const char *mc_json_type_name(mc_json_type type);

/* First member with this key, or NULL. */
const mc_json_value *mc_json_object_get(const mc_json_value *object, const char *key);

#endif
