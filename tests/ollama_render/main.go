// Renders an Ollama Modelfile TEMPLATE as Ollama does for a chat request, for tests/test_export.py.
//
// Ollama (github.com/ollama/ollama, template/template.go) executes a TEMPLATE that reads .Messages with Go's
// text/template, option missingkey=zero, one extra function (json), and the values System (every system
// message, joined), Messages (consecutive messages of one role merged, tool messages kept apart), Tools and an
// empty Response. Its api types (api/types.go) marshal tools and call arguments as compact JSON in the order
// they were given. Those parts are reproduced here in the standard library alone: Ollama's own module needs a
// newer toolchain and its dependencies from the network.
//
// stdin: {"template": "...", "messages": [...], "tools": [...]} in Ollama's /api/chat form; stdout: the prompt.
package main

import (
	"bytes"
	"encoding/json"
	"os"
	"strings"
	"text/template"
)

// Ordered is a JSON value kept as given, written compact (Ollama's ordered maps for arguments and properties).
type Ordered json.RawMessage

func (o Ordered) MarshalJSON() ([]byte, error) {
	if len(o) == 0 {
		return []byte("null"), nil
	}
	var b bytes.Buffer
	err := json.Compact(&b, o)
	return b.Bytes(), err
}

func (o *Ordered) UnmarshalJSON(data []byte) error {
	*o = append((*o)[0:0], data...)
	return nil
}

func (o Ordered) String() string {
	b, _ := o.MarshalJSON()
	return string(b)
}

type ToolCallFunction struct {
	Index     int     `json:"index,omitempty"`
	Name      string  `json:"name"`
	Arguments Ordered `json:"arguments"`
}

type ToolCall struct {
	ID       string           `json:"id,omitempty"`
	Function ToolCallFunction `json:"function"`
}

type Message struct {
	Role       string     `json:"role"`
	Content    string     `json:"content"`
	Thinking   string     `json:"thinking,omitempty"`
	ToolCalls  []ToolCall `json:"tool_calls,omitempty"`
	ToolName   string     `json:"tool_name,omitempty"`
	ToolCallID string     `json:"tool_call_id,omitempty"`
}

type ToolFunctionParameters struct {
	Type       string   `json:"type"`
	Defs       any      `json:"$defs,omitempty"`
	Items      any      `json:"items,omitempty"`
	Required   []string `json:"required,omitempty"`
	Properties Ordered  `json:"properties"`
}

type ToolFunction struct {
	Name        string                 `json:"name"`
	Description string                 `json:"description,omitempty"`
	Parameters  ToolFunctionParameters `json:"parameters"`
}

func (f ToolFunction) String() string {
	b, _ := json.Marshal(f)
	return string(b)
}

type Tool struct {
	Type     string       `json:"type"`
	Items    any          `json:"items,omitempty"`
	Function ToolFunction `json:"function"`
}

func main() {
	var request struct {
		Template string    `json:"template"`
		Messages []Message `json:"messages"`
		Tools    []Tool    `json:"tools"`
	}
	if err := json.NewDecoder(os.Stdin).Decode(&request); err != nil {
		panic(err)
	}
	funcs := template.FuncMap{"json": func(v any) string { b, _ := json.Marshal(v); return string(b) }}
	t := template.Must(template.New("").Option("missingkey=zero").Funcs(funcs).Parse(request.Template))

	var system []string
	var collated []*Message
	for i := range request.Messages {
		m := &request.Messages[i]
		if m.Role == "system" {
			system = append(system, m.Content)
		}
		if n := len(collated); n > 0 && collated[n-1].Role == m.Role && m.Role != "tool" {
			collated[n-1].Content += "\n\n" + m.Content
		} else {
			collated = append(collated, m)
		}
	}
	values := map[string]any{"System": strings.Join(system, "\n\n"), "Messages": collated,
		"Tools": request.Tools, "Response": ""}
	if err := t.Execute(os.Stdout, values); err != nil {
		panic(err)
	}
}
