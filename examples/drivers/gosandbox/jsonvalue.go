package main

// JSON as the protocol and the lease files hold it, read strictly: objects keep their keys'
// order (messages name the first bad key, as the suite's Python does) and a key given twice
// is refused; numbers keep the text they were written with (2 and 2.0 differ: a count is an
// integer). repr writes a value as Python's repr does, for messages the catalogue reads.

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/big"
	"sort"
	"strconv"
	"strings"
	"unicode"
	"unicode/utf8"
)

// Obj is a JSON object with its keys in the order they came.
type Obj struct {
	Keys []string
	M    map[string]any
}

func (o *Obj) Get(key string) (any, bool) {
	if o == nil {
		return nil, false
	}
	v, ok := o.M[key]
	return v, ok
}

// unknownKey: the first key of o that is not one of known.
func (o *Obj) unknownKey(known []string) (string, bool) {
	for _, key := range o.Keys {
		if !contains(known, key) {
			return key, true
		}
	}
	return "", false
}

func (o *Obj) MarshalJSON() ([]byte, error) {
	var b bytes.Buffer
	b.WriteByte('{')
	for i, k := range o.Keys {
		if i > 0 {
			b.WriteByte(',')
		}
		key, _ := json.Marshal(k)
		val, err := json.Marshal(o.M[k])
		if err != nil {
			return nil, err
		}
		b.Write(key)
		b.WriteByte(':')
		b.Write(val)
	}
	b.WriteByte('}')
	return b.Bytes(), nil
}

const maxDepth = 64

// decodeFirst reads the first JSON value of data (a BOM and white space before it are read
// over; bytes after it are ignored) into *Obj, []any, string, json.Number, bool or nil.
func decodeFirst(data []byte) (any, error) {
	data = bytes.TrimPrefix(data, []byte("\xef\xbb\xbf"))
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.UseNumber()
	return decodeValue(dec, 0)
}

// decodeLine reads one whole line as exactly one JSON value.
func decodeLine(line []byte) (any, error) {
	dec := json.NewDecoder(bytes.NewReader(line))
	dec.UseNumber()
	v, err := decodeValue(dec, 0)
	if err != nil {
		return nil, err
	}
	if _, err := dec.Token(); err != io.EOF {
		return nil, errors.New("more than one JSON value on a line")
	}
	return v, nil
}

func decodeValue(dec *json.Decoder, depth int) (any, error) {
	if depth > maxDepth {
		return nil, errors.New("nested too deeply")
	}
	tok, err := dec.Token()
	if err != nil {
		return nil, err
	}
	switch t := tok.(type) {
	case json.Delim:
		switch t {
		case '{':
			o := &Obj{M: map[string]any{}}
			for dec.More() {
				kt, err := dec.Token()
				if err != nil {
					return nil, err
				}
				key, ok := kt.(string)
				if !ok {
					return nil, errors.New("an object key that is not a string")
				}
				if _, dup := o.M[key]; dup {
					return nil, fmt.Errorf("the key %s appears twice in one object", repr(key))
				}
				v, err := decodeValue(dec, depth+1)
				if err != nil {
					return nil, err
				}
				o.Keys = append(o.Keys, key)
				o.M[key] = v
			}
			if _, err := dec.Token(); err != nil {
				return nil, err
			}
			return o, nil
		case '[':
			list := []any{}
			for dec.More() {
				v, err := decodeValue(dec, depth+1)
				if err != nil {
					return nil, err
				}
				list = append(list, v)
			}
			if _, err := dec.Token(); err != nil {
				return nil, err
			}
			return list, nil
		}
		return nil, fmt.Errorf("unexpected %v", t)
	default:
		return tok, nil
	}
}

// isInteger: a JSON number written as an integer (Python reads 2.0 as a float, 2 as an int).
func isInteger(n json.Number) bool {
	s := strings.TrimPrefix(string(n), "-")
	if s == "" {
		return false
	}
	for _, c := range s {
		if c < '0' || c > '9' {
			return false
		}
	}
	return true
}

// integral: the integer a number is, also when written 2.0 (JSON Schema's rule).
func integral(v any) (*big.Int, bool) {
	n, ok := v.(json.Number)
	if !ok {
		return nil, false
	}
	if isInteger(n) {
		i, ok := new(big.Int).SetString(string(n), 10)
		return i, ok
	}
	f, err := strconv.ParseFloat(string(n), 64)
	if err != nil || f != float64(int64(f)) {
		return nil, false
	}
	return big.NewInt(int64(f)), true
}

const shownLimit = 80

// shown writes a value for a message as gpuhost.errors.shown does: Python's repr, on one
// line, cut to 80 characters, saying how long it was.
func shown(v any) string {
	text := []rune(repr(v))
	if len(text) <= shownLimit {
		return string(text)
	}
	var size string
	switch t := v.(type) {
	case string:
		size = fmt.Sprintf("%d characters", utf8.RuneCountInString(t))
	case *Obj:
		size = plural(len(t.Keys), "key")
	case []any:
		size = plural(len(t), "item")
	case []string:
		size = plural(len(t), "item")
	default:
		size = fmt.Sprintf("%d characters", len(text))
	}
	return string(text[:shownLimit]) + "… (" + size + ")"
}

func plural(n int, what string) string {
	if n == 1 {
		return fmt.Sprintf("%d %s", n, what)
	}
	return fmt.Sprintf("%d %ss", n, what)
}

// named: a field for a message, itself when short and printable.
func named(field string) string {
	if len(field) <= 200 && printable(field) {
		return field
	}
	return shown(field)
}

func printable(s string) bool {
	for _, r := range s {
		if !unicode.IsPrint(r) {
			return false
		}
	}
	return true
}

// repr is Python's repr of a JSON value.
func repr(v any) string {
	switch t := v.(type) {
	case nil:
		return "None"
	case bool:
		if t {
			return "True"
		}
		return "False"
	case json.Number:
		return string(t)
	case int:
		return strconv.Itoa(t)
	case string:
		return pyString(t)
	case []string:
		items := make([]any, len(t))
		for i, s := range t {
			items[i] = s
		}
		return repr(items)
	case []any:
		parts := make([]string, len(t))
		for i, item := range t {
			parts[i] = repr(item)
		}
		return "[" + strings.Join(parts, ", ") + "]"
	case *Obj:
		parts := make([]string, len(t.Keys))
		for i, k := range t.Keys {
			parts[i] = pyString(k) + ": " + repr(t.M[k])
		}
		return "{" + strings.Join(parts, ", ") + "}"
	case map[string]any:
		keys := make([]string, 0, len(t))
		for k := range t {
			keys = append(keys, k)
		}
		sort.Strings(keys)
		return repr(&Obj{Keys: keys, M: t})
	}
	return fmt.Sprint(v)
}

func pyString(s string) string {
	quote := byte('\'')
	if strings.ContainsRune(s, '\'') && !strings.ContainsRune(s, '"') {
		quote = '"'
	}
	var b strings.Builder
	b.WriteByte(quote)
	for _, r := range s {
		switch {
		case r == rune(quote) || r == '\\':
			b.WriteByte('\\')
			b.WriteRune(r)
		case r == '\n':
			b.WriteString(`\n`)
		case r == '\r':
			b.WriteString(`\r`)
		case r == '\t':
			b.WriteString(`\t`)
		case r == ' ' || (unicode.IsPrint(r) && r != utf8.RuneError):
			b.WriteRune(r)
		case r < 0x100:
			fmt.Fprintf(&b, `\x%02x`, r)
		case r < 0x10000:
			fmt.Fprintf(&b, `\u%04x`, r)
		default:
			fmt.Fprintf(&b, `\U%08x`, r)
		}
	}
	b.WriteByte(quote)
	return b.String()
}
