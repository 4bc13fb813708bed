"""A ReAct-style calculator agent, written with nothing but the `openai` SDK.

loomrl trains it unmodified: each rollout runs this program in a sandbox with OPENAI_BASE_URL and
OPENAI_API_KEY pointing at the rollout's own gateway session, so every completion it asks for is
sampled by the policy being trained and recorded token for token. The program itself knows nothing
about RL. It reads its problem from task.json and prints its final answer; the task's verifier
scores that line.
"""

import ast
import json
import operator

from openai import OpenAI

SYSTEM = ("You are a helpful assistant with a calculator. To use it, reply with only calc(EXPRESSION). "
          "After you get the result, reply with: The answer is NUMBER.")
# Two worked examples as earlier turns: a 135M model needs them to use the tool at all.
EXAMPLES = [("Ben has 14 pens and gets 9 more. How many pens does Ben have now?", "14 + 9", "23"),
            ("What is 6 * 7?", "6 * 7", "42")]
TOOLS = [{"type": "function", "function": {
    "name": "calc", "description": "Evaluate an arithmetic expression.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}]
MAX_STEPS = 3
OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def calc(expression: str) -> str:
    """Arithmetic only: numbers, + - * / and parentheses."""
    def ev(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in OPS:
            return OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -ev(node.operand)
        raise ValueError("unsupported expression")
    try:
        value = ev(ast.parse(expression, mode="eval").body)
    except (ValueError, SyntaxError, ZeroDivisionError) as err:
        return f"Error: {err}"
    return str(int(value)) if float(value).is_integer() else f"{value:.4g}"


def main() -> None:
    client = OpenAI()  # OPENAI_BASE_URL and OPENAI_API_KEY come from the environment
    with open("task.json") as f:
        task = json.load(f)
    messages = [{"role": "system", "content": SYSTEM}]
    for question, expression, result in EXAMPLES:
        messages += [{"role": "user", "content": question}, {"role": "assistant", "content": f"calc({expression})"},
                     {"role": "user", "content": f"Result: {result}"},
                     {"role": "assistant", "content": f"The answer is {result}."}]
    messages.append({"role": "user", "content": task["prompt"]})
    for _ in range(MAX_STEPS):
        reply = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS, max_tokens=48)
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            print(message.content or "")
            return
        for call in message.tool_calls:  # act, then observe
            expression = json.loads(call.function.arguments).get("expression", "")
            messages.append({"role": "tool", "tool_call_id": call.id, "content": f"Result: {calc(expression)}"})
    print(messages[-1].get("content") or "")


if __name__ == "__main__":
    main()
