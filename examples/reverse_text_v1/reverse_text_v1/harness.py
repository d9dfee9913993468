"""An in-process chat harness: one model turn through the rollout's interception endpoint.

verifiers' `Harness.launch` contract allows a loop run in-process "as long as every model call goes through
`endpoint` + `secret`": the interception server records the turn into the trace (token ids, mask, logprobs) and
applies the run's sampling. Nothing runs in the runtime, so none needs a sandbox and nothing is installed at the
first rollout (the built-in `null`/`bash` harnesses set up a uv script there, which an offline machine cannot).
"""

from __future__ import annotations

import ssl

import httpx
import verifiers.v1 as vf
from pydantic import Field

_SSL_CONTEXT = ssl.create_default_context()
"""Built once: making one per rollout (what a new OpenAI/httpx client does) cost ~45% of the env server's CPU."""


class ReverseTextHarnessConfig(vf.HarnessConfig):
    max_turns: int = Field(1, ge=1)
    """Chat turns: the model answers; a later turn (multi-turn variants) gets "Try again." as the user."""


class ReverseTextHarness(vf.Harness[ReverseTextHarnessConfig]):
    APPENDS_SYSTEM_PROMPT = True
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(
        self,
        ctx: vf.ModelContext,
        trace: vf.Trace,
        runtime: vf.Runtime,
        endpoint: str,
        secret: str,
        mcp_urls: dict[str, str],
        data: vf.TaskData,
        tool_interception_url: str | None = None,
    ) -> vf.ProgramResult:
        system_prompt, prompt = self.resolve_prompt(data)
        messages: list[dict] = [{"role": "system", "content": system_prompt}] if system_prompt else []
        if isinstance(prompt, str):
            messages.append({"role": "user", "content": prompt})
        else:
            messages.extend(message.model_dump(exclude_none=True) for message in prompt or [])
        reply = ""
        async with httpx.AsyncClient(verify=_SSL_CONTEXT, timeout=None) as client:
            for turn in range(self.config.max_turns):
                response = await client.post(
                    f"{endpoint.rstrip('/')}/chat/completions",
                    headers={"Authorization": f"Bearer {secret}"},
                    json={"model": ctx.model, "messages": messages},
                )
                if response.status_code != 200:
                    return vf.ProgramResult(exit_code=1, stdout=reply, stderr=response.text[-2000:])
                reply = response.json()["choices"][0]["message"].get("content") or ""
                messages.append({"role": "assistant", "content": reply})
                if turn + 1 < self.config.max_turns:
                    messages.append({"role": "user", "content": "Try again."})
        return vf.ProgramResult(exit_code=0, stdout=reply, stderr="")
